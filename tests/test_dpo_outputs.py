"""DPO/KTO outputs and pair files are never overwritten, never stale, never foreign.
Real train_dpo.py runs on
the tiny model, real Parquet."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from ttsrl.model.checkpoint import MARKER, check_merged, write_marker
from ttsrl.train.pairs import Pair, read_pairs, write_pairs

TEXTS = ["你好", "今天天气很好", "银行的行长在行走。", "重庆"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TQDM_DISABLE="1")


@pytest.fixture(scope="module")
def pairs_file(lm, tmp_path_factory):
    sv, g = lm.vocab, torch.Generator().manual_seed(0)
    pairs = []
    for i, text in enumerate(TEXTS):
        ids = lm.tokenizer.encode(text, add_special_tokens=False)
        pairs.append(Pair(f"p{i}", text, [sv.sos_id] + ids + [sv.task_id],
                          torch.randint(0, 6561, (4 + i,), generator=g).tolist(),
                          torch.randint(0, 6561, (6 - i,), generator=g).tolist()))
    return write_pairs(pairs, tmp_path_factory.mktemp("pairs") / "pairs.parquet")


def train(tiny_hf, pairs, out, *extra):
    cmd = [sys.executable, str(ROOT / "train_dpo.py"), "--model", str(tiny_hf), "--pairs", str(pairs),
           "--out-dir", str(out), "--beta", "0.1", "--lr", "1e-3", "--batch-size", "2", "--max-steps", "2",
           "--save-steps", "1", "--threads", "1", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def an_earlier_run(tiny_hf, out, **info):
    """OUT/step_2 as an earlier train_dpo.py run left it (its marker names the trainer and records the
    run's settings; no RUN.json)."""
    step = out / "step_2"
    shutil.copytree(tiny_hf, step)
    settings = {"trainer": "dpo", "beta": 0.1, "loss_type": ["sigmoid"], "label_smoothing": 0.0}
    write_marker(step, {"step": 2, "source": "ttsrl dpo on pairs.parquet", **settings, "run": settings, **info})
    return step


@pytest.mark.slow  # a train_dpo.py round trip: ~8 s
def test_a_rerun_with_other_settings_refuses_and_says_what_differs(tiny_hf, pairs_file, tmp_path):
    out = tmp_path / "merged"
    old = an_earlier_run(tiny_hf, out)
    before = (old / MARKER).read_bytes()
    p = train(tiny_hf, pairs_file, out, "--loss-type", "ipo")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "loss_type: ['sigmoid'] then, ['ipo'] now" in p.stderr and "--force" in p.stderr
    assert (old / MARKER).read_bytes() == before and not (out / "step_1").exists()


@pytest.mark.slow  # two TRL training runs: ~21 s
def test_force_replaces_the_old_run_and_a_same_settings_rerun_rewrites_every_step(tiny_hf, pairs_file, tmp_path):
    out = tmp_path / "merged"
    an_earlier_run(tiny_hf, out)
    p = train(tiny_hf, pairs_file, out, "--loss-type", "ipo", "--force")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[dpo] saved" in p.stdout and "removed the earlier run's 1 step folder" in p.stdout
    for n in (1, 2):
        marker = json.loads((out / f"step_{n}" / MARKER).read_text())
        assert marker["loss_type"] == ["ipo"] and marker["run"]["lr"] == 1e-3 and check_merged(out / f"step_{n}") is None
    run = json.loads((out / "RUN.json").read_text())["settings"]
    assert run["loss_type"] == ["ipo"] and len(run["pairs_sha256"]) == 64
    # saved weights get the modes of a plain write, not save_model's 0600
    mask = os.umask(0)
    os.umask(mask)
    weights = next((out / "step_2").glob("*.safetensors"))
    assert stat.S_IMODE(weights.stat().st_mode) == 0o666 & ~mask
    # step_1's weights damaged: the same settings again rewrite it (it is not kept, not skipped)
    w1 = next((out / "step_1").glob("*.safetensors"))
    with open(w1, "r+b") as f:
        f.truncate(w1.stat().st_size - 100)
    assert check_merged(out / "step_1") is not None
    p = train(tiny_hf, pairs_file, out, "--loss-type", "ipo")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "same settings" in p.stdout
    assert check_merged(out / "step_1") is None and check_merged(out / "step_2") is None


@pytest.mark.slow  # two train_dpo.py round trips: ~18 s
def test_a_foreign_step_folder_is_never_deleted(tiny_hf, pairs_file, tmp_path):
    out = tmp_path / "merged"
    foreign = out / "step_2"
    foreign.mkdir(parents=True)
    (foreign / "my_notes.txt").write_text("not a checkpoint")
    for force in ([], ["--force"]):
        p = train(tiny_hf, pairs_file, out, *force)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
        assert "step_2 not written by train_dpo.py" in p.stderr and "never deleted" in p.stderr
        assert (foreign / "my_notes.txt").read_text() == "not a checkpoint"


# ---------------------------------------------------------------------------
# mine_pairs --out


def mine(lm, *args):
    cli = [sys.executable, str(ROOT / "mine_pairs.py"), "--model", str(lm.model.config._name_or_path), *args]
    return subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)


def user_pairs(path, rows=None):
    rows = rows or [{"id": "a", "text": "你好", "chosen": [1, 2, 3], "rejected": [4, 5]}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow  # five mine_pairs.py round trips: ~18 s
def test_mine_pairs_never_writes_over_its_input_or_an_existing_file(lm, tmp_path):
    src = user_pairs(tmp_path / "mine.jsonl")
    before = src.read_bytes()
    for out, force in ((src, []), (src, ["--force"])):
        p = mine(lm, "--user-pairs", str(src), "--out", str(out), *force)
        assert p.returncode == 2 and "is the input file" in p.stderr, p.stderr[-2000:]
    link = tmp_path / "link.parquet"
    link.symlink_to(src)
    p = mine(lm, "--user-pairs", str(src), "--out", str(link), "--force")
    assert p.returncode == 2 and "is the input file" in p.stderr
    assert src.read_bytes() == before
    other = tmp_path / "notes.parquet"
    other.write_text("mine")
    p = mine(lm, "--user-pairs", str(src), "--out", str(other))
    assert p.returncode == 2 and "exists; pass --force" in p.stderr and other.read_text() == "mine"
    p = mine(lm, "--user-pairs", str(src), "--out", str(other), "--force")
    assert p.returncode == 0, p.stderr[-2000:]
    assert read_pairs(other)[0].key == "a"
