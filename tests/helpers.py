"""Plain helpers shared by the tests (fixtures live in conftest.py, which imports these).

Test files import them as ``from helpers import ...``: pytest puts tests/ on ``sys.path``
(rootdir conftest, ``prepend`` import mode), and scripts/rehearsal.py adds it itself.
"""

import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start_reward_server(*args: str) -> tuple[subprocess.Popen, str]:
    """Start the reward server CLI as a user does, on a free loopback port; returns
    (process, URL) once it prints that it is ready. Its output keeps being drained."""
    from ttsrl.reward.health import launch_server

    try:
        return launch_server("--port", "0", *args)
    except RuntimeError as e:
        pytest.fail(str(e))


def cpu_config(**values):
    """``GRPOConfig`` of the ``cpu`` preset: the CPU path without the embedded run's values."""
    from ttsrl.train.grpo import GRPOConfig

    return GRPOConfig.from_preset("cpu", **values)


def dead_url() -> str:
    """A loopback URL nothing listens on (a port that was free a moment ago)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()



# ---------------------------------------------------------------------------
# real verl GRPO runs on CPU (test_grpo_cpu.py, test_grpo_world2.py)
# ---------------------------------------------------------------------------
def grpo_rows(texts: list[str], split: str) -> list[dict]:
    return [{"data_source": "tiny_tts", "prompt": [{"role": "user", "content": t}], "ability": "tts",
             "reward_model": {"style": "rule", "ground_truth": t}, "extra_info": {"split": split, "index": i}}
            for i, t in enumerate(texts)]


def make_grpo_workspace(ws: Path, n_texts: int = 12, n_val: int = 4) -> Path:
    """WS/hf_model (the tiny model after a few seconds of supervised pretraining on
    ``n_texts`` shipped sentences, so that sampled responses get different, non-zero sim
    rewards and GRPO has a signal), WS/train.parquet (those sentences) and
    WS/test.parquet (the first ``n_val``). Returns ``ws``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ttsrl.embedded.pretrain import PretrainConfig, build_base_model
    from ttsrl.embedded.tiny_model import TinyConfig
    from ttsrl.model.convert import cosyvoice_to_hf

    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:n_texts]
    (ws / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    texts = [json.loads(x)["text"] for x in lines]
    cfg = PretrainConfig(model=TinyConfig(tokenizer_vocab=4096), steps=120, span_prob=0.0, random_prob=0.0,
                         tone_noise=0.3, initial_noise=0.0)
    build_base_model(ws / "corpus.jsonl", ws / "cosyvoice", cfg, log=lambda s: None)
    cosyvoice_to_hf(ws / "cosyvoice", ws / "hf_model", log=lambda s: None)
    pq.write_table(pa.Table.from_pylist(grpo_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(grpo_rows(texts[:n_val], "test")), ws / "test.parquet")
    return ws


def grpo_command(ws: Path, *options: str, verl: tuple[str, ...] = ()) -> list[str]:
    """train_grpo.py --preset cpu on a ``make_grpo_workspace`` folder (checkpoints in WS/ckpt,
    the real reward file); ``options`` are more train_grpo.py options, ``verl`` raw overrides."""
    return [sys.executable, str(ROOT / "train_grpo.py"), "--preset", "cpu",
            "--model-path", str(ws / "hf_model"), "--train-files", str(ws / "train.parquet"),
            "--val-files", str(ws / "test.parquet"), "--checkpoint-dir", str(ws / "ckpt"),
            "--reward-file", str(ROOT / "reward_tts.py"), *options, "--", *verl]


def merge_command(ws: Path, out: Path) -> list[str]:
    """merge_checkpoints.py over a ``make_grpo_workspace`` run's WS/ckpt into ``out``."""
    return [sys.executable, str(ROOT / "merge_checkpoints.py"), "--ckpt-dir", str(ws / "ckpt"),
            "--out-dir", str(out), "--base-model", str(ws / "hf_model")]


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console logger lines -> {N: metrics}, read by the stage-2 console's own parser."""
    from ttsrl.console import parse_metrics

    steps: dict[int, dict[str, float]] = {}
    for line in log.replace("\r", "\n").splitlines():  # tqdm redraws with \r
        parsed = parse_metrics(line)
        if parsed:
            steps.setdefault(parsed[0], {}).update(parsed[1])
    return steps


def fsdp_full_state(actor: Path) -> dict:
    """The full tensors of an FSDP2 actor checkpoint (``model_world_size_N_rank_R.pt``, all N
    ranks), each rank's shard glued along its ``Shard`` dim: the fp32 master weights, read
    independently of merge_checkpoints.py."""
    import torch

    files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    assert files, f"no model_world_size_*_rank_*.pt in {actor}"
    world = int(files[0].name.split("_")[3])
    ranks = [torch.load(actor / f"model_world_size_{world}_rank_{r}.pt", map_location="cpu", weights_only=False)
             for r in range(world)]
    assert len(files) == world, f"{actor}: {len(files)} shard files for world size {world}"
    out = {}
    for key, first in ranks[0].items():
        if not hasattr(first, "_local_tensor"):
            out[key] = first
            continue
        (placement,) = first.placements
        assert placement.is_shard(), f"{key}: placement {placement}, expected Shard"
        out[key] = torch.cat([r[key]._local_tensor for r in ranks], dim=placement.dim)
    return out


def run_main(script: str, *args) -> subprocess.CompletedProcess:
    """A top-level CLI's ``main(argv)`` (``script``: its module name, e.g. ``prepare_data``) run in this
    process: its exit status, stdout and stderr as ``subprocess.run`` gives them, without starting an
    interpreter and importing torch again (seconds a call). For the many inputs of one check; each CLI
    is also run as a process by a test of its own."""
    main = importlib.import_module(script).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return subprocess.CompletedProcess([script, *map(str, args)], rc, out.getvalue(), err.getvalue())
