"""Named stage-2 variants: the estimator/loss (``ALGORITHMS``) and the rollout sampling (``SAMPLINGS``).

Each is data over ``ttsrl.train.grpo.GRPOConfig``: an algorithm is verl 0.9.1 Hydra overrides
(rendered by ``GRPOConfig.algorithm_overrides``), a sampling is field values (laid over a preset
by ``GRPOConfig.from_preset``). Adding one: an entry here, with its source.
"""

from __future__ import annotations

from typing import Optional

# Algorithm presets (--algorithm, ALGORITHM= in run.sh): overrides on top of the GRPO recipe,
# verl 0.9.1 keys only, with the values of each source (taken as they are, not retuned for speech).
# An entry may name {max_response_length} and {overlong_buffer} (filled in by algorithm_overrides).
#   grpo         DeepSeekMath (Shao et al. 2024, arXiv:2402.03300): advantages normalised by the group's
#                mean and std; the CosyVoice2 reference recipe (examples/grpo/cosyvoice2/run.sh)
#   grpo_no_std  Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783,
#                sec. 3.1): no std division and no per-response length normalisation: each response's
#                token sum over a constant, verl's loss_agg_mode seq-mean-token-sum-norm (verl's
#                docs/algo/grpo.md, "Dr.GRPO")
#   dapo         DAPO (Yu et al. 2025, arXiv:2503.14476) as verl's recipe/dapo/run_dapo_qwen2.5_32b.sh
#                sets it: clip-higher (eps_low 0.2, eps_high 0.28, dual-clip c 10), token-mean loss,
#                dynamic sampling by the reward score (a group whose samples all scored alike is dropped
#                and replaced: verl 0.9.1's v1 ReplayBuffer, trainer/ppo/v1/replay_buffer.py), overlong
#                reward shaping (verl's dapo reward manager: the last L_cache tokens of the budget cost
#                up to -1; the paper's L_cache/L_max = 4096/20480 = 1/5 of our budget), no KL. The dapo
#                manager replaces --reward-manager: it calls our reward function as naive does, then adds
#                the penalty. verl 0.9.1's v1 trainer ignores the recipe's max_num_gen_batches (it warns): no
#                cap on the prompts one step samples while groups keep scoring alike
#   rloo         RLOO (Ahmadian et al. 2024, arXiv:2402.14740): each sample's baseline is the mean reward
#                of the other n-1 (one update a batch, so the PPO ratio is 1 and this is REINFORCE)
#   gspo         GSPO (Zheng et al. 2025, arXiv:2507.18071, sec. 5.1): sequence-level importance ratio,
#                clip range 3e-4 left / 4e-4 right; verl's recipe/gspo: loss_agg_mode seq-mean-token-mean
#   gdpo         GDPO, verl 0.9.1's multi-reward estimator (core_algos.py:361-455): each reward component
#                (the client's term keys, ttsrl.reward.rewards: cer = the error-rate term, sim = speaker
#                similarity (a server with --want-sim), length = the length/finish term) normalised in
#                its group, then summed (equal weights, as NeMo Magpie-TTS weighs CER and SIM alike;
#                -- +algorithm.gdpo_reward_weights=[1.0,0.5,1.0] to change); the combined score is not
#                one of them. verl logs each as gdpo/<key>/mean. The legacy trainer: verl 0.9.1's
#                v1 trainer hands the estimator neither the extra info nor the prompts
#                (v1/trainer_base.py:1745-1746); the legacy one does (ray_trainer.py:1635-1636, 260-262)
# Any of them takes the KL loss (--use-kl-loss --kl-loss-coef X, low_var_kl): its keys are the recipe's.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "grpo": ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True"),
    "grpo_no_std": ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False",
                    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"),
    "dapo": (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=reward",
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.max_resp_len={max_response_length}",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward.reward_kwargs.overlong_buffer_cfg.len={overlong_buffer}",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
    ),
    "rloo": ("algorithm.adv_estimator=rloo",),
    "gspo": (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    ),
    "gdpo": ("algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[cer,sim,length]", "trainer.use_v1=False"),
}
DAPO_OVERLONG_SHARE = 4096 / 20480  # DAPO's L_cache / L_max (sec. 3.4; verl's dapo recipe: 4k of 20k)

# Rollout sampling presets (--sampling, SAMPLING= in run.sh): field values laid over the preset's.
#   reference  the CosyVoice2 reference recipe (the dataclass defaults): temperature 0.8, top-p 0.95,
#              top-k 25, n 4
#   mairhub    NVIDIA mair-hub's CosyVoice2 GRPO tutorial, its later commit: temperature 1.0, top-p 1.0
#              (no top-k), n 8, advantages not divided by the group's std
SAMPLINGS: dict[str, dict] = {
    "reference": {"temperature": 0.8, "top_p": 0.95, "top_k": 25, "n": 4},
    "mairhub": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 8, "norm_adv_by_std": False},
}


def own_policy_loss(algorithm: str) -> Optional[str]:
    """The policy-loss override ``algorithm`` sets, if any (verl's bypass mode would replace it)."""
    return next((o for o in ALGORITHMS.get(algorithm, ()) if ".policy_loss.loss_mode=" in o), None)
