"""``--algorithm dapo`` trained for real: 2 steps of verl 0.9.1 on CPU (our plugin, the ``hf``
rollout, the tiny model of conftest.py, the real reward client against the ``sim`` server), as small
as test_grpo_cpu.py's run. grpo trains in test_grpo_cpu.py, gdpo in test_gdpo.py; the others
(grpo_no_std, rloo, gspo) differ from those runs only in the estimator and policy loss verl
dispatches by name, which test_algorithms.py runs on real tensors with the config train_grpo.py's
command gives verl. DAPO alone changes the training loop: checked here, the steps ran, the config
verl itself resolved (Hydra's record of the run) holds DAPO's defining keys (``DEFINING``,
test_algorithms.py), group filtering is at work (its reward file, fixtures/flat_reward.py, gives
every sample of the first training text the same score, and verl's v1 ReplayBuffer reports that
group evicted: ``training/filter_groups/evicted_samples``, then refills the batch) and verl's dapo
reward manager, around our reward function, penalises overlong responses.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import grpo_command, parse_steps
from omegaconf import OmegaConf
from test_algorithms import DEFINING

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2
pytestmark = pytest.mark.slow  # real verl/Ray runs: minutes


@pytest.fixture(scope="module")
def workspace(grpo_workspace):
    return grpo_workspace  # conftest: one build for every GRPO run of the session; ckpt-ALGORITHM is this file's


def train(ws: Path, algorithm: str, url: str, *options: str, verl: tuple[str, ...] = ()) -> tuple[str, dict]:
    """STEPS steps of ``algorithm``; (verl's output, the config verl resolved)."""
    ckpt = ws / f"ckpt-{algorithm}"
    cmd = grpo_command(ws, "--algorithm", algorithm, "--checkpoint-dir", str(ckpt), "--train-batch-size", "4",
                       "--ppo-mini-batch-size", "4", "--micro-batch-size-per-gpu", "4", "--max-prompt-length", "64",
                       "--max-response-length", "32", "--total-training-steps", str(STEPS), "--save-freq", "-1",
                       "--test-freq", "-1", "--val-before-train", "false", "--lr", "1e-5", *options, verl=verl)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                          env={**os.environ, "TTSRL_REWARD_URL": url})
    (ws / f"train-{algorithm}.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout, OmegaConf.load(ckpt / "hydra" / ".hydra" / "config.yaml")


def test_dapo_trains_filters_flat_groups_and_penalises_overlong_responses(workspace, sim_server_url):
    # unshuffled, the flat text (index 0) is in the first batch
    log, cfg = train(workspace, "dapo", sim_server_url, "--reward-file",
                     str(ROOT / "tests" / "fixtures" / "flat_reward.py"), verl=("data.shuffle=False",))
    for key, want in DEFINING["dapo"].items():
        assert OmegaConf.select(cfg, key) == want, (key, OmegaConf.select(cfg, key))
    steps = parse_steps(log)
    assert sorted(s for s in steps if s > 0) == list(range(1, STEPS + 1)), sorted(steps)
    for s in range(1, STEPS + 1):
        assert "actor/pg_loss" in steps[s] and steps[s]["response_length/max"] <= 32, steps[s]
    evicted = sum(steps[s].get("training/filter_groups/evicted_samples", 0) for s in range(1, STEPS + 1))
    assert evicted >= 1, {s: sorted(k for k in steps[s] if "filter" in k) for s in steps}
    # overlong shaping: the last fifth of the 32-token budget (6 tokens) is penalised, up to -1, below the
    # reward's own floor of 0; a step whose longest response reached into it has a negative score
    assert OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg.len") == 6
    for s in range(1, STEPS + 1):
        if steps[s]["response_length/max"] > 32 - 6:
            assert steps[s]["critic/score/min"] < 0, steps[s]
