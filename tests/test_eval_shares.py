"""Stage 4 sharded over nodes (ttsrl.eval.shares, infer_dataset.py --node-share/--wait-shares):
two "nodes" give the same sweep as one, every utterance scored once, stale markers not
trusted. Real sweeps with the ``sim`` backend on the tiny checkpoint of conftest.py."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ttsrl.embedded import codec
from ttsrl.eval.evaluate import EvalConfig, run_sweep
from ttsrl.eval.shares import (
    NodeShare,
    check_marker,
    coverage,
    marker_path,
    share_steps,
    wait_for_shares,
    write_marker,
)
from ttsrl.model import vocab as V
from ttsrl.model.checkpoint import write_marker as mark_step_finished
from ttsrl.model.cosyvoice_lm import SamplingConfig
from ttsrl.model.generate import GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["你好", "今天天气很好", "银行的行长在行走。", "我用iPhone拍照，Hello world!", "重庆"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


# ---------------------------------------------------------------------------
# the split and the markers, without models


def test_shares_split_the_sorted_steps_disjointly():
    steps = [40, 0, 10, 30, 20]
    parts = [share_steps(steps, r, 2) for r in range(2)]
    assert parts == [[0, 20, 40], [10, 30]]
    assert share_steps(steps, 0, 1) == [0, 10, 20, 30, 40]
    assert share_steps([0], 2, 3) == []  # more nodes than models: a share may be empty
    assert NodeShare.parse(" 1/3 ") == NodeShare(1, 3) and str(NodeShare(1, 3)) == "1/3"
    for bad in ("2/2", "-1/2", "1-2", "a/b", "0/0", "1/2/3"):
        with pytest.raises(ValueError, match="R/N"):
            NodeShare.parse(bad)


def test_a_marker_counts_only_when_it_covers_this_run(tmp_path):
    fps, ts_fps, settings = {0: "f0", 2: "f2", 4: "f4"}, {"a": "t"}, {"greedy": False, "sampling": {"top_k": 25}}
    one = NodeShare(1, 2)
    covers = coverage(one, fps, ts_fps, settings, 4)
    assert covers["steps"] == [2] and covers["model_fingerprints"] == {"2": "f2"}
    assert check_marker(tmp_path, one, covers) == "no marker yet"
    t0 = time.time()
    write_marker(tmp_path, one, covers, scored=[2], cached=[], started=t0)
    m = json.loads(marker_path(tmp_path, one).read_text())
    assert marker_path(tmp_path, one).name == "1-of-2.json"
    assert (m["scored"], m["cached"], m["host"]) == ([2], [], os.uname().nodename)
    assert check_marker(tmp_path, one, covers) is None
    # another checkpoint, other settings or another test set: stale
    assert "step(s) 2 differ" in check_marker(tmp_path, one, coverage(one, {**fps, 2: "new"}, ts_fps, settings, 4))
    assert "settings" in check_marker(tmp_path, one, coverage(one, fps, ts_fps, {**settings, "greedy": True}, 4))
    assert "test_set_fingerprints" in check_marker(tmp_path, one, coverage(one, fps, {"a": "u"}, settings, 4))
    # a marker written before this run started does not count under --force
    assert "before this run" in check_marker(tmp_path, one, covers, not_before=time.time() + 1)
    marker_path(tmp_path, one).write_text("{")
    assert check_marker(tmp_path, one, covers).startswith("unreadable marker")

    # the head waits, naming the missing share, then gives up and says which
    logs = []
    two = NodeShare(2, 3)
    want = {1: coverage(NodeShare(1, 3), fps, ts_fps, settings, 4), 2: coverage(two, fps, ts_fps, settings, 4)}
    write_marker(tmp_path, two, want[2], scored=[4], cached=[], started=t0)
    missing = wait_for_shares(tmp_path, want, 3, timeout=0.6, log=logs.append, poll=0.1, every=0.2)
    assert list(missing) == [1] and missing[1] == "no marker yet"
    assert any(line.startswith("waiting for share 1/3 (steps 2): no marker yet") for line in logs)
    assert "still missing share 1/3 (steps 2)" in logs[-1] and "share 2/3" not in logs[-1]


# ---------------------------------------------------------------------------
# real sweeps


@pytest.fixture(scope="module")
def sweep_inputs(tiny_hf, lm, tmp_path_factory):
    """(start model, merged dir, test set of 5 lines). The merged steps speak differently
    from the start model, so a mix-up of steps shows: step 2 stops as soon as it may (eos
    favoured), step 4 says the letter a over and over."""
    d = tmp_path_factory.mktemp("shares")
    test = d / "test.jsonl"
    test.write_text("".join(json.dumps({"text": t, "id": f"t{i}"}, ensure_ascii=False) + "\n"
                            for i, t in enumerate(TEXTS)), encoding="utf-8")
    merged = d / "merged"
    favour = {2: lm.vocab.to_hf(V.family("cosyvoice2").eos_index), 4: lm.vocab.to_hf(codec.encode("a")[0])}
    for step, hf_id in favour.items():
        sd = merged / f"step_{step}"
        shutil.copytree(tiny_hf, sd)
        (f,) = sd.glob("*.safetensors")
        w = load_file(f)
        w["lm_head.bias"][hf_id] += 50.0
        save_file(w, f, metadata={"format": "pt"})
        mark_step_finished(sd, {"step": step})
    return tiny_hf, merged, test


def config(inputs, out, **kw) -> EvalConfig:
    start, merged, test = inputs
    return EvalConfig(start_model=str(start), merged_dir=str(merged), out_dir=str(out), test_sets=[("a", str(test))],
                      dev_sets=[("d", str(test))], engine="hf", device="cpu", threads=1, resamples=200, limit=3,
                      generation=GenerationConfig(sampling=SamplingConfig(max_token_text_ratio=3), seed=3), **kw)


def results(out: Path) -> dict[tuple[int, str], Path]:
    return {(int(p.parent.parent.name.removeprefix("step_")), p.parent.name): p for p in out.rglob("results.jsonl")}


def test_two_shares_give_the_one_node_sweep(sweep_inputs, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    want = run_sweep(config(sweep_inputs, one), log=lambda _: None)
    assert [(r["step"], r["test_set"]) for r in want] == [(s, n) for s in (0, 2, 4) for n in ("d", "a")]
    assert len({results(one)[(s, "a")].read_text() for s in (0, 2, 4)}) == 3  # each step its own outputs

    logs1 = []
    assert run_sweep(config(sweep_inputs, two, node_share=NodeShare(1, 2)), log=logs1.append) is None
    assert not (two / "report.md").exists() and not (two / "summary.json").exists()
    assert sorted(results(two)) == [(2, "a"), (2, "d")]  # share 1 of sorted (0, 2, 4): step 2 only
    assert any("no report on this node" in line for line in logs1)
    share1 = {k: p.stat().st_mtime_ns for k, p in results(two).items()}

    logs0 = []
    got = run_sweep(config(sweep_inputs, two, node_share=NodeShare(0, 2), wait_shares=60), log=logs0.append)
    assert got == want
    assert json.loads((two / "summary.json").read_text()) == json.loads((one / "summary.json").read_text())
    assert "| 4 | a | test |" in (two / "report.md").read_text()
    assert not any("final pass" in line for line in logs0)  # share 1 delivered: nothing left to score
    assert {k: results(two)[k].stat().st_mtime_ns for k in share1} == share1  # the head did not rewrite them

    # disjoint shares, every model in one, every utterance once per model and set
    m0, m1 = (json.loads(marker_path(two, NodeShare(r, 2)).read_text()) for r in (0, 1))
    assert (m0["steps"], m0["scored"], m1["steps"], m1["scored"]) == ([0, 4], [0, 4], [2], [2])
    for key, path in results(two).items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["id"] for r in rows] == ["t0", "t1", "t2"], key
        assert rows == [json.loads(line) for line in results(one)[key].read_text().splitlines()]

    # step 2 is rewritten (a new merge): share 1's marker is stale. The head waits a moment,
    # names it, and scores step 2 itself; the start model and step 4 stay cached.
    cfg2 = sweep_inputs[1] / "step_2" / "config.json"
    st = cfg2.stat()
    os.utime(cfg2, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    logs0.clear()
    got = run_sweep(config(sweep_inputs, two, node_share=NodeShare(0, 2), wait_shares=1), log=logs0.append)
    assert got == want  # same weights, same numbers
    assert any("still missing share 1/2 (steps 2): stale marker: model fingerprints of step(s) 2 differ" in line
               for line in logs0), logs0
    assert any(line == "final pass: scoring step(s) 2 on this node" for line in logs0)
    assert sum(line.endswith(": already scored (use --force to redo)") for line in logs0) == 4  # steps 0, 4
    assert all(results(two)[k].stat().st_mtime_ns != t for k, t in share1.items())


def cli(out, inputs, *extra):
    start, merged, test = inputs
    return [sys.executable, str(ROOT / "infer_dataset.py"), "--start-model", str(start), "--merged-dir", str(merged),
            "--out-dir", str(out), "--test-set", f"a={test}", "--limit", "2", "--greedy", "--max-token-text-ratio", "3",
            "--threads", "1", "--resamples", "200", "--engine", "hf", "--device", "cpu", *extra]


@pytest.mark.slow
@pytest.mark.extended  # the same split in-process and through run.sh run in the test command
def test_two_nodes_as_two_processes(sweep_inputs, tmp_path):
    """The CLI as run.sh runs it on two nodes: the head starts first and waits for share 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "eval"
    head = subprocess.Popen(cli(out, sweep_inputs, "--node-share", "0/2", "--wait-shares", "600"), cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        other = subprocess.run(cli(out, sweep_inputs, "--node-share", "1/2"), cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
        assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
        log, _ = head.communicate(timeout=600)
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
    assert head.returncode == 0, log[-3000:]
    assert "node share 0/2: step(s) 0, 4 of 0, 2, 4" in log and "every share is done" in log
    assert "final pass" not in log and "report.md" not in other.stdout
    rows = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == [0, 2, 4] and all(r["n"] == 2 for r in rows)
    ones = json.loads(marker_path(out, NodeShare(1, 2)).read_text())
    assert ones["scored"] == [2]


def test_cli_node_share_options(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from infer_dataset import parse_args

    base = ["--start-model", "m", "--out-dir", str(tmp_path), "--test-set", "t=a.jsonl"]
    cfg = parse_args(base + ["--node-share", "0/2", "--wait-shares", "90"])
    assert (cfg.node_share, cfg.wait_shares) == (NodeShare(0, 2), 90.0)
    cfg = parse_args(base + ["--node-share", "1/2"])
    assert (cfg.node_share, cfg.wait_shares) == (NodeShare(1, 2), None)
    assert (parse_args(base).node_share, parse_args(base).wait_shares) == (None, None)
    with pytest.raises(ValueError, match="head node"):
        EvalConfig(start_model="m", out_dir=str(tmp_path), test_sets=[], node_share=NodeShare(1, 2), wait_shares=5)
    for bad in (["--node-share", "2/2"], ["--wait-shares", "5"], ["--node-share", "1/2", "--wait-shares", "5"],
                ["--node-share", "0/2", "--wait-shares", "-1"], ["--node-share", "0/2", "--wait-shares", "86400"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


@pytest.mark.slow
def test_run_sh_stage_4_on_two_nodes(sweep_inputs, tmp_path):
    """run.sh's stage 4 on two nodes (NODE_IPS): node 1 scores its share and writes no report,
    node 0 (SHARE_WAIT_S) finds share 1's marker and writes the report of all three models."""
    start, merged, test = sweep_inputs
    exp = tmp_path / "exp"
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()
                      + f'\nEXP_DIR="{exp}"\nHF_MODEL_DIR="{start}"\nMERGED_DIR="{merged}"\nTEST_FILE="{test}"\n'
                      'DEV_SIZE=0\nEVAL_NPROC=1\nEVAL_ARGS=(--backend sim --test-set "a=$TEST_FILE" --limit 2 --greedy '
                      '--max-token-text-ratio 3 --threads 1 --resamples 200)\n')
    # two "nodes" on loopback addresses (run.sh derives NNODES=2 from NODE_IPS, as on a cluster)
    env = {**os.environ, "PRESET": str(preset), "NODE_IPS": "127.0.0.2,127.0.0.3", "OMP_NUM_THREADS": "1"}
    runs = {}
    for rank in ("1", "0"):
        runs[rank] = subprocess.run(["bash", str(ROOT / "run.sh"), "4", "4"], cwd=ROOT, capture_output=True, text=True,
                                    env={**env, "NODE_RANK": rank, "SHARE_WAIT_S": "5"}, timeout=600)
        assert runs[rank].returncode == 0, runs[rank].stdout[-3000:] + runs[rank].stderr[-3000:]
    assert "node share 1/2: step(s) 2 of 0, 2, 4" in runs["1"].stdout and "report:" not in runs["1"].stdout
    assert "every share is done" in runs["0"].stdout and "final pass" not in runs["0"].stdout
    rows = json.loads((exp / "eval" / "summary.json").read_text())
    assert [r["step"] for r in rows] == [0, 2, 4]
