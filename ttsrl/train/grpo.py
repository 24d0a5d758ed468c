"""Stage 2 configuration: a typed GRPO recipe -> Hydra overrides for verl 0.9.1.

``GRPOConfig`` carries the reference CosyVoice2 recipe's training settings moved
to verl 0.9.1's keys (the GPU preset); ``to_overrides`` renders them as the
command-line overrides of ``python -m verl.trainer.main_ppo``. ``device="cpu"``
adds what a CPU-only run needs (our plugin ``ttsrl.verl_plugin``, see its docstring),
and ``algorithm`` switches between GRPO variants without forking code.
Anything not modelled here is passed through as a raw Hydra override (``extra``),
applied last so it wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REWARD_FILE = REPO_ROOT / "reward_tts.py"

# Algorithm presets: overrides on top of the GRPO recipe. Every estimator and
# policy loss named here exists in verl 0.9.1's registries (core_algos).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    # group-normalised advantages, std division (the reference recipe)
    "grpo": ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True"),
    # Dr.GRPO-style: no std division (no bias towards low-variance groups)
    "grpo_no_std": ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False"),
    # DAPO-style: clip-higher, token-level loss, dynamic sampling (drop groups whose
    # samples all got the same reward)
    "dapo": (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=reward",
    ),
    # leave-one-out baseline
    "rloo": ("algorithm.adv_estimator=rloo",),
    # sequence-level importance ratio (GSPO paper's clip range)
    "gspo": (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    ),
}

DEVICES = ("gpu", "cpu")
LOGGERS = ("console", "wandb", "tensorboard")


def _hydra_value(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    s = str(v)
    if any(c in s for c in " ,=[]{}'\"()"):
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


@dataclass
class GRPOConfig:
    """Stage-2 settings. Defaults: the 8-GPU preset (reference recipe)."""

    model_path: str
    train_files: str
    val_files: str
    checkpoint_dir: str = "exp/checkpoints"
    reward_file: str = str(DEFAULT_REWARD_FILE)
    reward_function: str = "compute_score"
    reward_manager: str = "naive"  # speech tokens are not special, so naive's decode keeps them
    algorithm: str = "grpo"
    device: str = "gpu"
    # batch shape
    train_batch_size: int = 32
    ppo_mini_batch_size: int = 32
    micro_batch_size_per_gpu: int = 4
    lr: float = 1e-6
    max_prompt_length: int = 1024
    max_response_length: int = 512
    use_kl_loss: bool = False
    gradient_checkpointing: bool = True
    # rollout
    rollout: str = "vllm"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    n: int = 4
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 25
    # schedule
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    save_freq: int = 100
    test_freq: int = 100
    val_before_train: bool = True
    resume_mode: str = "auto"
    # cluster
    n_gpus_per_node: int = 8
    nnodes: int = 1
    # logging
    project_name: str = "ttsrl"
    experiment_name: str = "cosyvoice2_grpo"
    loggers: tuple[str, ...] = ("console",)
    # raw Hydra overrides, applied last
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: expected one of {sorted(ALGORITHMS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: expected one of {DEVICES}")
        bad = [x for x in self.loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"loggers {bad}: expected some of {LOGGERS}")
        for name in ("train_batch_size", "ppo_mini_batch_size", "micro_batch_size_per_gpu", "n",
                     "max_prompt_length", "max_response_length", "n_gpus_per_node", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ppo_mini_batch_size > self.train_batch_size:
            raise ValueError(f"ppo_mini_batch_size {self.ppo_mini_batch_size} > train_batch_size "
                             f"{self.train_batch_size}")
        self.loggers = tuple(self.loggers)

    @classmethod
    def cpu_preset(cls, **kw) -> "GRPOConfig":
        """The embedded CPU preset: one logical GPU, the ``hf`` rollout, console logs."""
        base = dict(device="cpu", rollout="hf", n_gpus_per_node=1, loggers=("console",))
        base.update(kw)
        return cls(**base)

    # ------------------------------------------------------------------------
    def recipe_overrides(self) -> list[str]:
        """The recipe itself, device independent."""
        v = _hydra_value
        ar = "actor_rollout_ref"
        mb = self.micro_batch_size_per_gpu
        sampling = []
        for prefix in (f"{ar}.rollout", f"{ar}.rollout.val_kwargs"):
            sampling += [f"{prefix}.temperature={v(self.temperature)}", f"{prefix}.top_p={v(self.top_p)}",
                         f"{prefix}.top_k={v(self.top_k)}"]
        out = [
            f"data.train_files={v(self.train_files)}",
            f"data.val_files={v(self.val_files)}",
            "data.prompt_key=prompt",
            f"data.train_batch_size={self.train_batch_size}",
            f"data.max_prompt_length={self.max_prompt_length}",
            f"data.max_response_length={self.max_response_length}",
            "data.filter_overlong_prompts=True",
            "data.truncation=error",
            "data.trust_remote_code=True",
            f"{ar}.model.path={v(self.model_path)}",
            f"{ar}.model.trust_remote_code=True",  # keeps the custom class with the lm_head bias
            f"{ar}.model.use_fused_kernels=False",  # fused kernels drop the lm_head bias
            f"{ar}.model.enable_gradient_checkpointing={v(self.gradient_checkpointing)}",
            f"{ar}.actor.optim.lr={v(self.lr)}",
            f"{ar}.actor.ppo_mini_batch_size={self.ppo_mini_batch_size}",
            f"{ar}.actor.ppo_micro_batch_size_per_gpu={mb}",
            f"{ar}.actor.use_kl_loss={v(self.use_kl_loss)}",
            f"{ar}.actor.use_fused_kernels=False",
            f"{ar}.ref.log_prob_micro_batch_size_per_gpu={mb}",
            f"{ar}.rollout.name={self.rollout}",
            f"{ar}.rollout.tensor_model_parallel_size={self.tensor_parallel_size}",
            f"{ar}.rollout.gpu_memory_utilization={v(self.gpu_memory_utilization)}",
            f"{ar}.rollout.log_prob_micro_batch_size_per_gpu={mb}",
            f"{ar}.rollout.n={self.n}",
            f"{ar}.rollout.val_kwargs.do_sample=True",
            f"{ar}.rollout.val_kwargs.n=1",
            *sampling,
            f"reward.custom_reward_function.path={v(self.reward_file)}",
            f"reward.custom_reward_function.name={v(self.reward_function)}",
            f"reward.reward_manager.name={self.reward_manager}",
            "algorithm.use_kl_in_reward=False",
            *ALGORITHMS[self.algorithm],
            f"trainer.project_name={v(self.project_name)}",
            f"trainer.experiment_name={v(self.experiment_name)}",
            f"trainer.logger={v(list(self.loggers))}",
            f"trainer.default_local_dir={v(self.checkpoint_dir)}",
            # Hydra's run folder (resolved config + log) next to the checkpoints, not in the cwd
            f"hydra.run.dir={v(str(Path(self.checkpoint_dir) / 'hydra'))}",
            f"trainer.n_gpus_per_node={self.n_gpus_per_node}",
            f"trainer.nnodes={self.nnodes}",
            f"trainer.save_freq={self.save_freq}",
            f"trainer.test_freq={self.test_freq}",
            f"trainer.total_epochs={self.total_epochs}",
            f"trainer.resume_mode={self.resume_mode}",
            f"trainer.val_before_train={v(self.val_before_train)}",
            "trainer.critic_warmup=0",
        ]
        if self.total_training_steps is not None:
            out.append(f"trainer.total_training_steps={self.total_training_steps}")
        return out

    def cpu_overrides(self) -> list[str]:
        """What a CPU-only machine needs (see ``ttsrl.verl_plugin``); used with ``cpu_env()``."""
        ar = "actor_rollout_ref"
        return [
            "trainer.device=cpu",
            "+ray_kwargs.ray_init.num_gpus=1",  # one logical GPU for verl's resource pools
            "ray_kwargs.ray_init.num_cpus=32",  # logical: actors must not starve on a small CPU machine
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            f"{ar}.actor.strategy=fsdp2",
            f"{ar}.ref.strategy=fsdp2",
            f"{ar}.actor.use_torch_compile=False",
            f"{ar}.ref.use_torch_compile=False",
            f"{ar}.actor.fsdp_config.use_torch_compile=False",
            f"{ar}.ref.fsdp_config.use_torch_compile=False",
            f"+{ar}.model.override_config.attn_implementation=eager",  # no flash-attn
            f"{ar}.model.use_remove_padding=False",
            f"{ar}.rollout.dtype=float32",
            # fp32 compute in actor and ref, as in the fp32 hf rollout (verl's default is bf16
            # autocast: slower on most CPUs and ~1e-2 apart from the rollout's probabilities)
            *(f"+{ar}.{role}.fsdp_config.mixed_precision.{k}=fp32" for role in ("actor", "ref")
              for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
            f"{ar}.rollout.calculate_log_probs=True",  # rollout vs actor log-prob metrics
            f"{ar}.rollout.agent.num_workers=1",
            "reward.num_workers=1",
            "data.dataloader_num_workers=0",
        ]

    def to_overrides(self) -> list[str]:
        out = self.recipe_overrides()
        if self.device == "cpu":
            out += self.cpu_overrides()
        return out + list(self.extra)

    def env(self) -> dict[str, str]:
        """Environment the run needs (plugin import path, CPU platform)."""
        from ttsrl.verl_plugin import PLUGIN_MODULE, cpu_env

        env = cpu_env() if self.device == "cpu" else {"VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE}
        path = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
        return env

