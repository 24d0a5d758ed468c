"""The named stage-2 variants (ttsrl/train/algorithms.py) in verl 0.9.1's own composed config:
each algorithm's defining keys with its source's values, DAPO's overlong buffer as verl's dapo
reward manager reads it, the KL loss on any of them, the rollout samplings over the presets.
No training here (test_grpo_algorithms.py trains each one)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from test_grpo import REQUIRED_ARGV, composed, gpu

from ttsrl.train.grpo import ALGORITHMS, GRPOConfig


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_composes_and_exists_in_verl(algorithm):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    for c in (gpu(algorithm=algorithm), GRPOConfig.cpu_preset(model_path="m", train_files="t", val_files="v",
                                                            algorithm=algorithm)):
        cfg = composed(c.to_overrides())
        get_adv_estimator_fn(cfg.algorithm.adv_estimator)
        get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)


# the keys that define each algorithm, with its source's values (ttsrl/train/algorithms.py), as verl's
# own config holds them; test_grpo_algorithms.py checks them again in the config of a real run
DEFINING = {
    "grpo": {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True,
             "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
             "actor_rollout_ref.actor.loss_agg_mode": "token-mean"},
    "grpo_no_std": {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
                    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"},
    "dapo": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.clip_ratio_low": 0.2,
             "actor_rollout_ref.actor.clip_ratio_high": 0.28, "actor_rollout_ref.actor.clip_ratio_c": 10.0,
             "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "algorithm.filter_groups.enable": True,
             "algorithm.filter_groups.metric": "reward", "reward.reward_manager.name": "dapo",
             "reward.reward_kwargs.overlong_buffer_cfg.enable": True,
             "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 1.0},
    "rloo": {"algorithm.adv_estimator": "rloo", "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla"},
    "gspo": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
             "actor_rollout_ref.actor.clip_ratio_low": 0.0003, "actor_rollout_ref.actor.clip_ratio_high": 0.0004},
    "gdpo": {"algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_keys": ["cer", "sim", "length"],
             "trainer.use_v1": False},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_algorithm_defining_keys_in_verls_config(algorithm):
    assert set(DEFINING) == set(ALGORITHMS)
    cfg = composed(gpu(preset="gpu8", algorithm=algorithm).to_overrides())
    for key, want in DEFINING[algorithm].items():
        assert OmegaConf.select(cfg, key) == want, (key, OmegaConf.select(cfg, key))
    assert cfg.algorithm.use_kl_in_reward is False and cfg.actor_rollout_ref.actor.use_kl_loss is False
    filtering = OmegaConf.select(cfg, "algorithm.filter_groups.enable")
    assert filtering is (algorithm == "dapo")
    # the recipe's KL loss in any of them: one field each, one override line each (recipe_overrides)
    kl = composed(gpu(algorithm=algorithm, use_kl_loss=True, kl_loss_coef=0.01).to_overrides())
    assert kl.actor_rollout_ref.actor.use_kl_loss is True and kl.actor_rollout_ref.actor.kl_loss_coef == 0.01
    assert kl.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"


def test_dapo_overlong_buffer_is_the_papers_share_of_the_budget():
    """DAPO's L_cache / L_max = 4096 / 20480: the last fifth of the response budget is penalised,
    by verl's dapo reward manager (it reads reward.reward_kwargs as built here)."""
    from verl.experimental.reward_loop.reward_manager.dapo import DAPORewardManager

    for max_len, buffer in ((512, 102), (64, 13), (32, 6)):
        cfg = composed(gpu(algorithm="dapo", max_response_length=max_len).to_overrides())
        kw = cfg.reward.reward_kwargs
        assert (kw.max_resp_len, kw.overlong_buffer_cfg.len) == (max_len, buffer)
        manager = DAPORewardManager(cfg, tokenizer=None, compute_score=lambda **k: 0.0)
        assert manager.max_resp_len == max_len and manager.overlong_buffer_cfg.len == buffer


def test_samplings_lay_their_values_over_the_preset():
    import train_grpo

    ref = composed(gpu(preset="gpu8").to_overrides())
    mair = composed(gpu(preset="gpu8", sampling="mairhub").to_overrides())
    for s in (mair.actor_rollout_ref.rollout, mair.actor_rollout_ref.rollout.val_kwargs):
        assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, -1)
    assert mair.actor_rollout_ref.rollout.n == 8 and mair.algorithm.norm_adv_by_std_in_grpo is False
    assert mair.data.train_batch_size == ref.data.train_batch_size and mair.trainer.n_gpus_per_node == 8
    # the reference sampling is the default: named, it changes nothing on the reference recipe
    assert composed(gpu(preset="gpu8", sampling="reference").to_overrides()) == ref
    # over the embedded preset (n=8) it sets n=4; options given on the command line win over it
    assert GRPOConfig.from_preset("embedded", sampling="reference", model_path="m", train_files="t",
                                  val_files="v").n == 4
    cfg, *_ = train_grpo.build(["--preset", "embedded", "--sampling", "mairhub", "--n", "2", *REQUIRED_ARGV])
    assert (cfg.n, cfg.temperature, cfg.norm_adv_by_std) == (2, 1.0, False)
    # no std division on top of an algorithm that divides
    assert composed(gpu(algorithm="dapo", sampling="mairhub").to_overrides()).algorithm.norm_adv_by_std_in_grpo \
        is False
    with pytest.raises(ValueError, match="sampling 'nope'"):
        GRPOConfig.from_preset("gpu", sampling="nope", model_path="m", train_files="t", val_files="v")


def test_bypass_mode_refuses_an_algorithm_with_its_own_policy_loss():
    """verl's bypass mode swaps in its own loss: with GSPO's sequence-level loss that would be a
    silent change of algorithm. The embedded preset's bypass yields to such an algorithm (so
    ALGORITHM=gspo runs on it); asked for explicitly, it is an error."""
    import train_grpo

    with pytest.raises(ValueError, match="gspo.*--bypass-old-log-prob false"):
        train_grpo.build(["--preset", "embedded", "--algorithm", "gspo", "--bypass-old-log-prob", "true",
                          *REQUIRED_ARGV])
    for extra in ([], ["--bypass-old-log-prob", "false"]):
        cfg, cmd, *_ = train_grpo.build(["--preset", "embedded", "--algorithm", "gspo", *extra, *REQUIRED_ARGV])
        assert "algorithm.rollout_correction.bypass_mode=False" in cmd
        assert "actor_rollout_ref.actor.policy_loss.loss_mode=gspo" in cmd
    cfg, cmd, *_ = train_grpo.build(["--preset", "embedded", "--algorithm", "dapo", *REQUIRED_ARGV])
    assert cfg.bypass_old_log_prob is True  # the other algorithms keep the preset's bypass
