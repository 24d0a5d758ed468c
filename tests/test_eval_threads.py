"""Stage 4 on gpu8: torch CPU threads are capped on every rank, GPU ranks
too (cores / local ranks, or --threads), and the preset samples 64 sequences per rank at once."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from ttsrl.eval import dist
from ttsrl.eval import evaluate as ev

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("requested,local_world,cores,expected", [
    (0, 8, 192, 24),  # an 8-GPU node: its cores shared by its 8 ranks
    (0, 8, 4, 1),  # fewer cores than ranks: one each, never 0
    (0, 1, 16, 16),  # one rank: every core
    (3, 8, 192, 3),  # --threads wins
])
def test_rank_threads(requested, local_world, cores, expected):
    assert dist.rank_threads(requested, local_world, cores) == expected


def test_usable_cores_follow_the_affinity_mask():
    if hasattr(os, "sched_getaffinity"):
        assert dist.usable_cores() == len(os.sched_getaffinity(0))
    assert dist.usable_cores() >= 1


class _Stop(Exception):
    pass


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_rank_caps_its_threads_gpu_ranks_too(monkeypatch, tmp_path, device):
    """A rank of `torchrun --nproc_per_node 8` on a 192-core node: 24 torch threads, on a GPU
    rank as on a CPU one (GPU ranks kept torch's default, every core, in each of 8 ranks)."""
    import torch

    threads = []
    monkeypatch.setenv("WORLD_SIZE", "1")  # no process group; LOCAL_WORLD_SIZE is what counts
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(dist, "usable_cores", lambda: 192, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 192)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(ev, "pin_local_gpu", lambda d: None)
    monkeypatch.setattr(ev, "_device", lambda cfg: "cuda:0" if device == "cuda" else "cpu")

    def stop(cfg, device):
        raise _Stop

    monkeypatch.setattr(ev, "_choose_engine", stop)
    with pytest.raises(_Stop):
        ev.run_sweep(ev.EvalConfig(start_model="m", out_dir=str(tmp_path), test_sets=[], device=device))
    assert threads == [24]


def test_gpu8_samples_64_sequences_per_rank():
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "--config"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PRESET": "presets/gpu8.sh"}, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("EVAL_ARGS=("))
    args = shlex.split(line[len("EVAL_ARGS=("):-1])
    assert args[args.index("--batch-size") + 1] == "64", args
