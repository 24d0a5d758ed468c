"""``--algorithm gdpo``: verl 0.9.1's multi-reward estimator on ttsrl's reward components.

No training: verl's own ``ppo_trainer.yaml`` is composed with our overrides, and verl's own
``compute_advantage`` (the legacy trainer's call, ``trainer/ppo/ray_trainer.py:1667-1675``) runs
on a batch whose extra info is what ``compute_score`` returns (the terms ``cer``, ``sim``, ``length``): the keys we
name must be the ones it finds, and each component must move the advantages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import cpu_config  # noqa: E402
from test_grpo import composed, gpu  # noqa: E402

from ttsrl.reward.client import _result  # noqa: E402


def test_gdpo_composes_with_the_legacy_trainer_and_our_reward_keys():
    for c in (gpu(algorithm="gdpo"), cpu_config(model_path="m", train_files="t", val_files="v", algorithm="gdpo")):
        cfg = composed(c.to_overrides())
        assert cfg.algorithm.adv_estimator == "gdpo"
        assert list(cfg.algorithm.gdpo_reward_keys) == ["cer", "sim", "length"]
        assert set(cfg.algorithm.gdpo_reward_keys) <= set(_result(0.5, 0.1, "x", False, 0.7))
        # the v1 trainer fetches neither the extra info nor the prompts for the estimator
        assert cfg.trainer.use_v1 is False
    weighted = composed(gpu(algorithm="gdpo", extra=["+algorithm.gdpo_reward_weights=[1.0,0.5,1.0]"]).to_overrides())
    assert list(weighted.algorithm.gdpo_reward_weights) == [1.0, 0.5, 1.0]


def _batch(results: list[dict], group: int):
    """A DataProto as the legacy trainer holds it at advantage time (ray_trainer.py:1635-1636)."""
    from verl import DataProto

    n, prompt_len, resp_len = len(results), 3, 5
    attention = torch.ones(n, prompt_len + resp_len, dtype=torch.long)
    attention[0, -2:] = 0  # a shorter response
    response_mask = attention[:, prompt_len:].clone()
    rewards = torch.zeros(n, resp_len)
    last = response_mask.sum(1) - 1
    rewards[torch.arange(n), last] = torch.tensor([r["score"] for r in results])
    batch = {"prompts": torch.zeros(n, prompt_len, dtype=torch.long), "attention_mask": attention,
             "response_mask": response_mask, "token_level_rewards": rewards}
    extra = {k: np.array([r[k] for r in results]) for k in results[0]}
    uid = np.array([f"g{i // group}" for i in range(n)], dtype=object)
    return DataProto.from_dict(tensors=batch, non_tensors={**extra, "uid": uid})


def test_verl_gdpo_estimator_reads_our_terms_from_our_extra_info():
    from verl.trainer.ppo.ray_trainer import compute_advantage

    cfg = composed(gpu(algorithm="gdpo").to_overrides()).algorithm

    def advantages(results):
        out = compute_advantage(_batch(results, 4), adv_estimator=cfg.adv_estimator, config=cfg,
                                norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
        return out.batch["advantages"]

    # two groups of four; the same error-rate rewards, speaker similarity differs in group 2 only
    scores = [0.9, 0.5, 0.5, 0.1, 0.7, 0.7, 0.7, 0.7]
    sims = [0.6, 0.6, 0.6, 0.6, 0.2, 0.8, 0.5, 0.5]
    flat = [_result(s, 0.1, "t", False, 0.6, cer=s, length=1.0) for s in scores]
    mixed = [_result(s, 0.1, "t", False, m, cer=s, length=1.0) for s, m in zip(scores, sims)]
    a, b = advantages(flat), advantages(mixed)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    # group 2: equal rewards, equal SIM: one advantage for all four (the batch whitening shifts it)
    assert torch.allclose(a[4:, 0], a[4, 0].expand(4))
    assert b[5, 0] > b[6, 0] > b[4, 0] and b[6, 0] == b[7, 0]  # ... until SIM differs: the higher SIM gains
    assert b[0, -2:].abs().sum() == 0  # nothing past a response's end
    # an unmeasured SIM (failed request, empty response) is 0.0, never NaN in the estimator
    failed = [_result(s, 0.1, "t", i == 0, float("nan"), cer=s, length=1.0) for i, s in enumerate(scores)]
    assert failed[0]["sim"] == 0.0 and torch.isfinite(advantages(failed)).all()
    # the length term moves them too: in group 2 (all else equal) an unfinished rollout falls behind
    cut = [_result(s, 0.1, "t", False, 0.6, cer=s, length=0.0 if i == 5 else 1.0, finished=i != 5)
           for i, s in enumerate(scores)]
    c = advantages(cut)
    assert c[5, 0] < c[4, 0] and torch.allclose(c[4:, 0][[0, 2, 3]], c[4, 0].expand(3))


def test_gdpo_without_our_keys_is_refused_by_verl():
    """What verl says when the extra info lacks a component (a reward function without ``sim``)."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    cfg = composed(gpu(algorithm="gdpo").to_overrides()).algorithm
    results = [{k: v for k, v in _result(0.5, 0.1, "t", False, 0.5).items() if k != "sim"} for _ in range(4)]
    with pytest.raises(AssertionError, match="GDPO reward key 'sim' not found"):
        compute_advantage(_batch(results, 4), adv_estimator=cfg.adv_estimator, config=cfg)


@pytest.mark.slow  # a real verl/Ray run: minutes
def test_gdpo_trains_on_the_cpu_path(grpo_workspace, sim_server_url):
    """Two GRPO steps with ``--algorithm gdpo`` through train_grpo.py (verl's legacy trainer, our
    plugin, the hf rollout), rewarded by reward_tts.py and the sim server (no speaker model: the
    ``sim`` component is 0.0 throughout, so only ``score`` moves the advantages)."""
    import os
    import subprocess

    from helpers import grpo_command, parse_steps

    ws = grpo_workspace  # conftest: the session's one GRPO workspace; this run's checkpoints in ckpt-gdpo
    cmd = grpo_command(ws, "--algorithm", "gdpo", "--checkpoint-dir", str(ws / "ckpt-gdpo"), "--train-batch-size", "4",
                       "--ppo-mini-batch-size", "4",
                       "--micro-batch-size-per-gpu", "4", "--max-prompt-length", "64", "--max-response-length", "32",
                       "--total-training-steps", "2", "--save-freq", "-1", "--test-freq", "-1", "--lr", "1e-5")
    env = {**os.environ, "TTSRL_REWARD_URL": sim_server_url}
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    steps = parse_steps(proc.stdout)
    assert "val-aux/tiny_tts/sim/mean@1" in steps[0]  # validation logs the extra info
    for s in (1, 2):
        m = steps[s]
        assert 0.0 < m["gdpo/cer/mean"] <= 1.0 and 0.0 <= m["gdpo/length/mean"] <= 1.0, m
        assert 0.0 < m["critic/score/mean"] < 1.0
        # the plugin's per-step terms (ttsrl.verl_plugin.reward_metrics) agree with verl's gdpo ones
        for key in ("cer", "sim", "length"):
            assert m[f"reward/{key}/mean"] == pytest.approx(m[f"gdpo/{key}/mean"], abs=1e-6), (key, m)
        assert 0.0 <= m["reward/unfinished/mean"] <= 1.0
