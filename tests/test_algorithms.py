"""The named stage-2 variants (ttsrl/train/algorithms.py) in verl 0.9.1's own composed config:
each algorithm's defining keys with its source's values, DAPO's overlong buffer as verl's dapo
reward manager reads it, the KL loss on any of them, the rollout samplings over the presets.
Each algorithm's effect (advantages, policy loss) in verl's own code on real tensors, with the config
train_grpo.py's command gives verl; no training here (test_grpo_algorithms.py trains dapo)."""

from __future__ import annotations

import pytest
from helpers import cpu_config
from omegaconf import OmegaConf
from test_grpo import REQUIRED_ARGV, composed, gpu

from ttsrl.train.grpo import ALGORITHMS, GRPOConfig


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_composes_and_exists_in_verl(algorithm):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    for c in (gpu(algorithm=algorithm), cpu_config(model_path="m", train_files="t", val_files="v", algorithm=algorithm)):
        cfg = composed(c.to_overrides())
        get_adv_estimator_fn(cfg.algorithm.adv_estimator)
        get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)


# the keys that define each algorithm, with its source's values (ttsrl/train/algorithms.py), as verl's
# own config holds them; checked again below in the config train_grpo.py's command gives verl, and dapo's in
# the config of a real run (test_grpo_algorithms.py)
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


# ---------------------------------------------------------------------------
# each algorithm's effect in verl's own code, on real tensors, with the config verl's main_ppo reads from
# train_grpo.py's command (the CPU path, as the real runs: test_grpo_cpu.py trains grpo,
# test_grpo_algorithms.py dapo, test_gdpo.py gdpo; the others differ from those runs only in the
# estimator and policy loss verl dispatches by name, which run here)
def verl_config(algorithm: str):
    """verl's config as ``train_grpo.py --preset cpu --algorithm ALGORITHM`` hands it to verl's main_ppo
    (the overrides of its command composed with verl's ppo_trainer.yaml: what Hydra records of a run)."""
    import train_grpo

    run = train_grpo.build(["--preset", "cpu", "--algorithm", algorithm, "--max-response-length", "32",
                            *REQUIRED_ARGV])
    assert run.command[1:3] == ["-m", "verl.trainer.main_ppo"], run.command[:3]
    return composed(run.command[3:])


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_train_grpos_command_gives_verl_each_algorithms_defining_keys(algorithm):
    from verl.trainer.ppo.utils import need_critic

    cfg = verl_config(algorithm)
    for key, want in DEFINING[algorithm].items():
        assert OmegaConf.select(cfg, key) == want, (key, OmegaConf.select(cfg, key))
    with pytest.warns(UserWarning, match="Disabled critic"):
        assert need_critic(cfg) is False  # none of them needs a critic (verl: only GAE does)


def _advantages(algorithm: str, scores: list[float], lengths: list[int], group: int):
    """verl's advantages for one-reward-per-response rollouts (the reward on each response's last
    token, groups of ``group`` consecutive rows), computed by the v1 trainer's own call
    (trainer_base.py ``_compute_advantage``; a row's key is ``{uid}_{session}_{turn}``, one session per
    sample, one turn each) with ``algorithm``'s config; (advantages, response mask)."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    cfg = verl_config(algorithm)
    n, width = len(scores), max(lengths) + 2
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    rewards = torch.zeros(n, width)
    rewards[torch.arange(n), torch.tensor(lengths) - 1] = torch.tensor(scores)
    uids = [f"g{i // group}" for i in range(n)]
    data = DataProto.from_dict(tensors={"response_mask": mask, "token_level_rewards": rewards},
                               non_tensors={"uid": np.array(uids, dtype=object)})
    a = cfg.algorithm
    out = compute_advantage_for_multi_trajectories(
        data, batch_keys=[f"{u}_{i % group}_0" for i, u in enumerate(uids)], adv_estimator=a.adv_estimator, gamma=a.gamma,
        lam=a.lam, num_repeat=cfg.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=a.get("norm_adv_by_std_in_grpo", True), config=a)
    return out.batch["advantages"], mask


SCORES = [0.9, 0.5, 0.3, 0.1, 0.7, 0.7, 0.7, 0.7]  # two groups of four; the second scores alike
LENGTHS = [3, 5, 2, 4, 4, 1, 3, 5]


def test_rloo_baseline_is_the_mean_of_the_other_samples_of_the_group():
    import torch

    adv, mask = _advantages("rloo", SCORES, LENGTHS, 4)
    r = torch.tensor(SCORES).view(2, 4)
    want = (r - (r.sum(1, keepdim=True) - r) / 3).view(-1)  # r_i - mean of the other n-1
    assert torch.allclose(adv, want[:, None] * mask, atol=1e-6), adv  # on every response token, 0 past its end
    assert adv[4:].abs().max() < 1e-6  # a group scoring alike: no signal


def test_grpo_divides_by_the_groups_std_and_grpo_no_std_does_not():
    import torch

    r = torch.tensor(SCORES).view(2, 4)
    centred = (r - r.mean(1, keepdim=True)).view(-1)
    adv, mask = _advantages("grpo_no_std", SCORES, LENGTHS, 4)
    assert torch.allclose(adv, centred[:, None] * mask, atol=1e-6), adv
    adv, mask = _advantages("grpo", SCORES, LENGTHS, 4)
    std = r.std(1, keepdim=True).expand(2, 4).reshape(-1)
    assert torch.allclose(adv[:4], (centred[:4] / (std[:4] + 1e-6))[:, None] * mask[:4], atol=1e-5), adv
    assert adv[4:].abs().max() < 1e-6


def _policy_loss(algorithm: str, log_ratio: list[list[float]], advantages: list[float]):
    """verl's policy loss as its actor computes it (workers/utils/losses.py ``ppo_loss``, one data-parallel
    rank): ``algorithm``'s actor config, the loss its ``policy_loss.loss_mode`` names, aggregated by its
    ``loss_agg_mode``; old log-probs 0, new ones ``log_ratio`` (one list per response, padded with 0).
    (loss, d loss / d log-prob, metrics, response mask)."""
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(verl_config(algorithm).actor_rollout_ref.actor)
    width = max(map(len, log_ratio)) + 2
    mask = torch.tensor([[t < len(x) for t in range(width)] for x in log_ratio])
    log_prob = torch.tensor([x + [0.0] * (width - len(x)) for x in log_ratio], dtype=torch.float64,
                            requires_grad=True)
    actor.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=len(log_ratio),
                                   loss_scale_factor=actor.loss_scale_factor)
    loss, metrics = get_policy_loss_fn(actor.policy_loss.get("loss_mode", "vanilla"))(
        old_log_prob=torch.zeros_like(log_prob), log_prob=log_prob,
        advantages=torch.tensor(advantages, dtype=torch.float64)[:, None] * mask, response_mask=mask,
        loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None)
    loss.backward()
    return loss, log_prob.grad, metrics, mask


def test_gspo_ratio_is_the_sequences_and_clipped_at_3e4_and_4e4():
    import math

    import torch

    ratios = [[1e-3, -6e-4, -1e-4],  # mean 1e-4: inside the range, though its first token alone is not
              [6e-4] * 5,  # mean 6e-4 > 4e-4 with a positive advantage: clipped
              [-5e-4] * 4]  # mean -5e-4 < -3e-4 with a negative advantage: clipped
    loss, grad, metrics, mask = _policy_loss("gspo", ratios, [1.0, 1.0, -1.0])
    s0 = math.exp(1e-4)
    # sequence-level: every token of response 0 gets the same gradient, its sequence ratio over its
    # length and the batch (seq-mean-token-mean); the clipped responses none
    assert torch.allclose(grad[0, :3], torch.full((3,), -s0 / 3 / 3, dtype=torch.float64)), grad
    assert grad[1:].abs().max() == 0 and grad[0, 3:].abs().max() == 0, grad
    assert loss.item() == pytest.approx((-s0 - (1 + 4e-4) + (1 - 3e-4)) / 3, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(9 / 12)
    # the same responses under grpo's token-level ratio: token 0 of response 0 weighs more than its others
    _, token_level, _, _ = _policy_loss("grpo", ratios, [1.0, 1.0, -1.0])
    assert token_level[0, 0] < token_level[0, 1] < 0, token_level


def test_grpo_no_std_loss_does_not_normalise_by_the_responses_length():
    import torch

    loss, grad, _, mask = _policy_loss("grpo_no_std", [[0.0] * 2, [0.0] * 6], [1.0, 1.0])
    g = grad[mask.bool()]
    assert torch.allclose(g, g[0].expand_as(g)) and g[0] < 0, grad  # every token weighs alike, short or long
    _, per_response, _, _ = _policy_loss("gspo", [[0.0] * 2, [0.0] * 6], [1.0, 1.0])  # seq-mean-token-mean
    assert per_response[0, 0] == pytest.approx(3 * per_response[1, 0].item())
