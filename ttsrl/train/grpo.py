"""Stage 2 configuration: a typed GRPO recipe -> Hydra overrides for verl 0.9.1.

``GRPOConfig`` carries the reference CosyVoice2 recipe's training settings moved
to verl 0.9.1's keys; ``PRESETS`` name the runs (``gpu8``, ``embedded``, and the bare
``gpu``/``cpu`` paths) as field values over those defaults. ``to_overrides`` renders a
config as the command-line overrides of ``python -m verl.trainer.main_ppo``.
``device="cpu"`` adds what a CPU-only run needs (our plugin ``ttsrl.verl_plugin``, see
its docstring); ``algorithm`` and ``sampling`` pick named variants (``ttsrl.train.algorithms``).
A multi-node run (``nnodes > 1`` or ``ray_address``) attaches to a running Ray cluster,
forwards the workers' environment and refuses relative paths (``ttsrl.train.cluster``).
Anything not modelled here is passed through as a raw Hydra override (``extra``),
applied last so it wins.

Adding a setting: one field declared with ``option(default, help=...)`` (that is also
its ``train_grpo.py`` option and ``--help``) and, when it maps to verl, one line in
``recipe_overrides``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ttsrl.cli import option, option_fields
from ttsrl.families import sampling_rules
from ttsrl.reward.backends import BACKENDS
from ttsrl.reward.rewards import REWARDS, WEIGHTS, check_weight, sim_weight_of, weights_help
from ttsrl.train import cluster
from ttsrl.train.algorithms import ALGORITHMS, DAPO_OVERLONG_SHARE, SAMPLINGS, own_policy_loss

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REWARD_FILE = REPO_ROOT / "reward_tts.py"

DEVICES = ("gpu", "cpu")
LOGGERS = ("console", "wandb", "tensorboard")

#: --rollout-rule's choices: "none" (plain top-k/top-p) or a family's current rule, the kind the hf rollout draws by
ROLLOUT_RULES = ("none", *(r for r in sampling_rules() if r.endswith("-2026")))


# Named presets: field values over the dataclass defaults (the reference recipe on one GPU).
# train_grpo.py --preset NAME; flags given on its command line win over the preset.
_CPU = {"device": "cpu", "rollout": "hf", "n_gpus_per_node": 1}
PRESETS: dict[str, dict] = {
    # the reference recipe as declared below (one GPU unless --n-gpus-per-node)
    "gpu": {},
    # the CPU path: our verl plugin, the hf rollout, one logical GPU (--n-gpus-per-node 2: FSDP
    # world size 2 on one raylet, tests/test_grpo_world2.py; tests and benchmarks
    # give their own batch shape on top)
    "cpu": _CPU,
    # presets/gpu8.sh: the reference recipe on one node of 8 GPUs
    "gpu8": {"n_gpus_per_node": 8},
    # presets/embedded.sh: the tiny stage -1 model on a 2-core CPU. 16 prompts x n=8 samples a
    # step, 80 steps (~3.9 epochs of the 329 prompts left after the 64-text dev slice, 20.6
    # steps an epoch); the tiny model needs a far larger lr than the 0.5B recipe's 1e-6; the
    # simulated codec's responses are short (64 codes). For speed, none of which changes what is
    # learned: the fp32 hf rollout's log-probs are the actor's (max |p diff| 2e-5 measured), so
    # they serve as old log-probs (no second forward pass); no validation inside stage 2 (stage 4
    # scores every saved step on dev and test); no activation recomputation (a tiny model needs
    # no memory saved); a checkpoint every 40 steps gives stage 5 steps 40 and 80 to choose from.
    "embedded": {**_CPU, "experiment_name": "embedded", "train_batch_size": 16, "ppo_mini_batch_size": 16,
                 "micro_batch_size_per_gpu": 32, "n": 8, "lr": 3e-4, "max_response_length": 64,
                 "total_epochs": 4, "total_training_steps": 80, "save_freq": 40, "test_freq": -1,
                 "val_before_train": False, "gradient_checkpointing": False, "bypass_old_log_prob": True},
}
# presets/embedded.sh's zero-shot run (its default): the same, with four policy updates a step
# (mini-batches of 4 prompts x 8 samples; the rollout's log-probs serve the later ones as old log-probs,
# PPO's clip bounds them) and rollouts at temperature 1.0, CosyVoice's own; the work per step is the same.
# (chosen on an earlier start model, 2026-12-04: test CER -31.0% and -32.0% at step 80 where one update at 0.8
# gave -25.6..-28.9% and -32.1%). 20 steps, a checkpoint every 10: from today's start model (test CER 11.0% on a
# 2-core AMD EPYC), against CER 1 + SIM 0.5, with rollouts drawn by stage 4's rule (a family's own, so
# presets/embedded.sh sets rollout_rule, not this preset), 33-44% of the CER is gone by step 10 and 42-51% by step 20
# with SIM within 0.011 of the start in five runs; in 40-step trials of an earlier world the later steps traded CER back
# for SIM; the run takes 7-9 minutes on a 2-core Intel Xeon, 12-15 on a 2-core AMD EPYC without AVX-512
# (docs/results.md).
PRESETS["embedded_zeroshot"] = {**PRESETS["embedded"], "experiment_name": "embedded_zeroshot",
                                "ppo_mini_batch_size": 4, "temperature": 1.0,
                                "total_training_steps": 20, "save_freq": 10}

# presets/speech_cpu.sh: the kokoro family's tiny LM against the real-speech reward on a 2-core CPU, where
# scoring a rollout (Kokoro-82M + Whisper-base + Resemblyzer) takes about a second: 8 prompts x n=4
# samples a step, 24 steps, two policy updates a step (mini-batches of 4 prompts x 4), rollouts at
# temperature 1.0 and the embedded preset's top-p 0.95 (measured on 120 test sentences, one draw each, with
# the earlier voice prompts, two of which the base model read badly:
# 16 steps at 0.95 lowered CER by 7.9 points [-16.9, +0.2], 24 steps at stage 4's own 0.8 by 3.4
# [-12.4, +4.3]; lr 1e-3 with four updates a step lost length and finish within 5 steps); phoneme
# responses run to 104 codes (the longest training sentence: 102 phonemes, its voice token and the stop);
# a checkpoint every 12 steps gives stage 5 steps 12 and 24 to choose from.
PRESETS["speech_cpu"] = {**PRESETS["embedded"], "experiment_name": "speech_cpu", "train_batch_size": 8,
                         "ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 16, "n": 4, "lr": 3e-4,
                         "max_response_length": 112, "total_training_steps": 24, "save_freq": 12,
                         "temperature": 1.0}

#: keys a field sets only as a consequence (worker counts follow nnodes, Ray's logical GPUs the ranks):
#: an override of one of them is the user's own choice, not a shadowed field
CONSEQUENCES = frozenset({"reward.num_workers", "actor_rollout_ref.rollout.agent.num_workers",
                          "ray_kwargs.ray_init.num_gpus"})


def _keyed(overrides: list[str]) -> dict[str, str]:
    """Hydra overrides as key -> value (``+``/``~`` prefixes dropped)."""
    return dict((o.split("=", 1) + [""])[:2] for o in (x.lstrip("+~") for x in overrides))


def _another(value, choices=None):
    """A value other than ``value`` of its type (for :meth:`GRPOConfig.owned_keys`)."""
    if choices:
        other = [c for c in choices if c != value and (c,) != value]
        return (other[0],) if isinstance(value, tuple) else other[0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if value is None:
        return 1
    return f"{value}_other" if isinstance(value, str) else value


def _hydra_value(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    s = str(v)
    if any(c in s for c in " ,=[]{}'\"()\\$"):
        return cluster.hydra_quote(s)  # read back exactly (a backslash was doubled before)
    return s


@dataclass
class GRPOConfig:
    """Stage-2 settings, each with its ``--help`` text (``train_grpo.py`` builds its options
    from these fields). Defaults: the reference CosyVoice2 recipe on one GPU; ``PRESETS``
    below set the cluster shape and the embedded run's values on top."""

    model_path: str = option(help="the Hugging Face checkpoint to train (stage -1's hf_model/ or a merged step)")
    train_files: str = option(help="training Parquet from stage 0 (train.parquet)")
    val_files: str = option(help="validation Parquet from stage 0 (test.parquet)")
    checkpoint_dir: str = option("exp/checkpoints", help="where verl writes global_step_N/ (and resumes from)")
    reward_file: str = option(str(DEFAULT_REWARD_FILE), help="Python file holding the reward function verl calls")
    reward_function: str = option("compute_score", help="name of the reward function in --reward-file")
    # speech tokens are not special tokens, so naive's decode keeps them
    reward_manager: str = option("naive", help="verl reward manager (naive: one call per response, batched by "
                                               "the server)")
    # the reward this run trains on (run.sh's REWARD, REWARD_BACKEND, REWARD_URLS): reaches the reward
    # function through verl's reward.custom_reward_function.reward_kwargs, and the run record
    reward: Optional[str] = option(None, choices=REWARDS,
                                   help="the reward variant this run trains on (REWARDS in ttsrl/reward/rewards.py): "
                                        "every server must serve it, checked before verl starts, and the reward "
                                        "function refuses an answer scored by another; none: what the servers serve")
    reward_weights: Optional[str] = option(None, choices=WEIGHTS,
                                           help="the named weighting of the combined reward this run trains on "
                                                "(REWARD_WEIGHTS; the servers' --weights): " + weights_help()
                                                + "; none: what the servers serve")
    sim_weight: Optional[float] = option(None,
                                         help="the SIM weight of the combined reward this run trains on (the servers' "
                                              "--sim-weight): every server must serve it, checked before verl starts, "
                                              "and the reward function refuses an answer combined with another; none: the "
                                              "weight of --reward-weights, else what the servers serve")
    mos_weight: Optional[float] = option(None,
                                         help="the MOS (naturalness) weight of the combined reward this run trains on "
                                              "(the servers' --mos-weight): checked like --sim-weight; none: what the "
                                              "servers serve")
    reward_backend: Optional[str] = option(None, choices=BACKENDS,
                                           help="the speech backend the reward servers must serve; none: any")
    reward_urls: Optional[str] = option(None, help="the reward servers, comma-separated (one road: verl's reward_kwargs "
                                                   "to the reward function); none: $TTSRL_REWARD_URL, else "
                                                   "http://127.0.0.1:8000")
    algorithm: str = option("grpo", choices=tuple(ALGORITHMS),
                            help="advantage/loss variant, with its source's values (ALGORITHMS in "
                                 "ttsrl/train/algorithms.py, each with its source)")
    norm_adv_by_std: Optional[bool] = option(
        None, help="divide GRPO advantages by the group's std (none: as --algorithm says; --sampling mairhub: false)")
    device: str = option("gpu", choices=DEVICES, help="gpu, or cpu: our verl plugin's CPU path (ttsrl.verl_plugin)")
    # batch shape
    train_batch_size: int = option(32, help="prompts per training step")
    ppo_mini_batch_size: int = option(32, help="prompts per optimiser update (<= --train-batch-size)")
    micro_batch_size_per_gpu: int = option(4, help="sequences per forward/backward pass on one GPU")
    lr: float = option(1e-6, help="actor learning rate")
    max_prompt_length: int = option(1024, help="prompt budget in tokens (longer prompts are dropped by verl)")
    max_response_length: int = option(512, help="most speech tokens generated per response")
    use_kl_loss: bool = option(False, help="add a KL penalty to the reference model to the loss")
    kl_loss_coef: float = option(0.001, help="weight of the KL loss (with --use-kl-loss true; verl's default)")
    kl_loss_type: str = option("low_var_kl", choices=("low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2", "low_var_kl+",
                                                      "k3+", "kl+", "k1+"),
                               help="KL estimator of the KL loss (verl's kl_penalty; + = k2 gradient, straight-through)")
    gradient_checkpointing: bool = option(True, help="recompute activations in the backward pass (less memory, "
                                                     "slower)")
    bypass_old_log_prob: bool = option(False, help="use the rollout's log-probs as the PPO ratio's old log-probs "
                                                   "instead of recomputing them with the actor (verl's rollout_correction "
                                                   "bypass mode); exact only when rollout and actor compute alike")
    # rollout
    rollout: str = option("vllm", help="generation engine: vllm (GPU) or hf (transformers, the CPU path)")
    tensor_parallel_size: int = option(1, help="GPUs per vLLM rollout engine")
    gpu_memory_utilization: float = option(0.6, help="fraction of GPU memory vLLM may take")
    n: int = option(4, help="responses sampled per prompt (the GRPO group size)")
    temperature: float = option(0.8, help="rollout sampling temperature")
    top_p: float = option(0.95, help="rollout nucleus sampling threshold")
    top_k: int = option(25, help="rollout top-k sampling (CosyVoice2 samples with 25; -1: off)")
    rollout_rule: str = option(
        "none", choices=ROLLOUT_RULES,
        help="the hf rollout only: draw rollouts by this CosyVoice sampling rule, the one stage 4 scores with "
             "(repetition-aware redraws of a code already said in the last 10), with the rollout's top-p and top-k at "
             "temperature 1.0 and no minimum length; none: plain top-k/top-p")
    sampling: Optional[str] = option(
        None, choices=tuple(SAMPLINGS), help="a named rollout sampling (SAMPLINGS in ttsrl/train/algorithms.py, "
        "each with its source) laid over the preset's values; options given here win over it; none: the preset's")
    seed: Optional[int] = option(
        None, help="seed of the prompt order (verl's data.seed) and of rollout sampling (rollout.seed: vLLM's "
                   "sampler; the hf rollout seeds torch with it, replica rank added as verl does for vLLM); "
                   "none: verl's defaults (torch's fixed default generator for the order, rollout seed 42)")
    # schedule
    total_epochs: int = option(1, help="passes over the training data")
    total_training_steps: Optional[int] = option(None, help="stop after this many steps (none: epochs x batches)")
    save_freq: int = option(100, help="save a checkpoint every N steps")
    test_freq: int = option(100, help="validate every N steps (-1: never; stage 4 scores every saved step)")
    val_before_train: bool = option(True, help="validate once before the first step")
    resume_mode: str = option("auto", help="verl resume mode: auto (newest global_step_N), disable, resume_path")
    # cluster
    n_gpus_per_node: int = option(1, help="GPUs per node (the CPU path: logical GPUs, one FSDP rank each)")
    nnodes: int = option(1, help="nodes in the Ray cluster (> 1: a multi-node run, see --ray-address)")
    ray_address: Optional[str] = option(
        None, help="attach to this running Ray cluster (host:port or auto); default: $RAY_ADDRESS; unset: start a "
                   "local Ray. A multi-node run (this set or --nnodes > 1) forwards the workers' environment "
                   "(TTSRL_*, VERL_*, HF_*, NCCL_*, PYTHONPATH...: ttsrl/train/cluster.py) and needs absolute paths "
                   "every node mounts; secrets (*_TOKEN, *_KEY...) are not forwarded: export them on every node "
                   "before `ray start`")
    # logging
    project_name: str = option("ttsrl", help="project name for the loggers")
    experiment_name: str = option("cosyvoice2_grpo", help="experiment name for the loggers (and verl's folders)")
    loggers: tuple[str, ...] = option(("console",), choices=LOGGERS, help="comma-separated loggers")
    # raw Hydra overrides, applied last (train_grpo.py: everything after --)
    extra: list[str] = option([], cli=False, help="raw verl Hydra overrides, applied last")

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: expected one of {sorted(ALGORITHMS)}")
        if self.sampling is not None and self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling {self.sampling!r}: expected one of {sorted(SAMPLINGS)}")
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
        rows, ranks = self.ppo_mini_batch_size * self.n, self.n_gpus_per_node * self.nnodes
        if rows % ranks == 0 and self.micro_batch_size_per_gpu > rows // ranks:
            # a micro-batch is a memory bound: one larger than a rank's mini-batch means "all of it in one
            # pass" (the embedded presets' 32 under SAMPLING=reference's n=4: 16 rows a rank)
            self.micro_batch_size_per_gpu = rows // ranks
        if rows % ranks == 0 and (rows // ranks) % self.micro_batch_size_per_gpu:
            # verl's fixed-size micro-batching asserts this deep inside the first update, minutes in
            raise ValueError(f"a mini-batch is {self.ppo_mini_batch_size} prompts x n={self.n} = {rows} rows, "
                             f"{rows // ranks} a rank: not a multiple of micro_batch_size_per_gpu "
                             f"{self.micro_batch_size_per_gpu}, which verl splits it into (set "
                             "--micro-batch-size-per-gpu to a divisor)")
        if self.rollout_rule != "none" and (self.rollout != "hf" or self.temperature != 1.0):
            raise ValueError(f"rollout_rule {self.rollout_rule} needs the hf rollout at temperature 1.0, got "
                             f"rollout {self.rollout} at {self.temperature}: pass --rollout-rule none (run.sh: "
                             "GRPO_EXTRA=\"--rollout-rule none\") to sample plain top-k/top-p")
        own_loss = own_policy_loss(self.algorithm)
        if self.bypass_old_log_prob and own_loss:
            # verl's bypass mode replaces the policy loss with its own (ppo_clip on rollout log-probs)
            raise ValueError(f"algorithm {self.algorithm!r} sets its own policy loss ({own_loss}), which "
                             "bypass_old_log_prob would replace: pass --bypass-old-log-prob false")
        self.loggers = tuple(self.loggers)
        self.ray_address = self.ray_address or None
        relative = cluster.relative_paths({f: getattr(self, f) for f in cluster.RELATIVE_PATH_FIELDS})
        if self.multi_node and relative:
            name, value = relative[0]
            raise ValueError(f"{name}={value!r} is a relative path, but a multi-node run (nnodes={self.nnodes}, "
                             f"ray_address={self.ray_address!r}) resolves it in each worker's own working "
                             "directory: use an absolute path on a filesystem every node mounts")

        sim_weight_of(self.reward_weights, self.sim_weight)  # ValueError: unknown name, bad or conflicting weight
        check_weight("mos_weight", self.mos_weight)
        shadowed = self.shadowed_overrides()
        if shadowed:
            raise ValueError("; ".join(shadowed))

    def owned_keys(self) -> dict[str, str]:
        """verl key -> the field that sets it: each option field changed alone (no checks run), the
        keys whose rendered value follows it (or that appear when an unset field is set)."""
        base = _keyed(self.to_overrides({}, raw=False))
        out: dict[str, str] = {}
        for f in option_fields(type(self)):
            other = copy.copy(self)
            setattr(other, f.name, _another(getattr(self, f.name), f.metadata.get("choices")))
            try:
                changed = _keyed(other.to_overrides({}, raw=False))
            except (ValueError, KeyError, TypeError):  # a value this field cannot take alone
                continue
            for key, value in changed.items():
                if key not in out and key not in CONSEQUENCES and (base.get(key, value if getattr(self, f.name) is not None else None) != value):
                    out[key] = f.name
        return out

    def shadowed_overrides(self) -> list[str]:
        """A sentence per raw override (``extra``) that sets a key a field owns: it would win over
        the field, skip its checks and leave the run record saying otherwise."""
        if not self.extra:
            return []
        owned = self.owned_keys()
        out = []
        for item in self.extra:
            key = item.split("=", 1)[0].lstrip("+~")
            if key in owned:
                flag = "--" + owned[key].replace("_", "-")
                out.append(f"the override {item!r} sets {key}, which GRPOConfig.{owned[key]} owns: give it as "
                           f"{flag} VALUE (run.sh: GRPO_EXTRA=\"{flag} VALUE\"), so its checks and ttsrl_run.json "
                           "see it")
        return out

    @property
    def expected_sim_weight(self) -> Optional[float]:
        """The SIM weight the run asks for (``sim_weight``, else ``reward_weights``'); None: any."""
        return sim_weight_of(self.reward_weights, self.sim_weight)

    @property
    def multi_node(self) -> bool:
        """Several nodes, or attached to a running cluster (``ttsrl.train.cluster``)."""
        return self.nnodes > 1 or self.ray_address is not None

    @classmethod
    def from_preset(cls, preset: str, **values) -> "GRPOConfig":
        """The named preset (``PRESETS``), then the named sampling (``SAMPLINGS``, when ``values``
        has one), then ``values`` over them (explicit settings win). A preset's bypass of the old
        log-probs yields to an algorithm with its own policy loss (given explicitly, it is an error)."""
        if preset not in PRESETS:
            raise ValueError(f"unknown GRPO preset {preset!r}; known presets: {', '.join(PRESETS)}")
        base = {**PRESETS[preset], **SAMPLINGS.get(values.get("sampling"), {})}  # unknown: __post_init__ says
        if own_policy_loss(values.get("algorithm", base.get("algorithm", "grpo"))):
            base.pop("bypass_old_log_prob", None)
        return cls(**{**base, **values})

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
            f"{ar}.actor.kl_loss_coef={v(self.kl_loss_coef)}",
            f"{ar}.actor.kl_loss_type={self.kl_loss_type}",
            f"{ar}.actor.use_fused_kernels=False",
            f"{ar}.ref.log_prob_micro_batch_size_per_gpu={mb}",
            f"{ar}.rollout.name={self.rollout}",
            f"{ar}.rollout.tensor_model_parallel_size={self.tensor_parallel_size}",
            f"{ar}.rollout.gpu_memory_utilization={v(self.gpu_memory_utilization)}",
            f"{ar}.rollout.log_prob_micro_batch_size_per_gpu={mb}",
            f"{ar}.rollout.n={self.n}",
            *([f"+{ar}.rollout.custom.sampling_rule={self.rollout_rule}"] if self.rollout_rule != "none" else []),
            f"{ar}.rollout.val_kwargs.do_sample=True",
            f"{ar}.rollout.val_kwargs.n=1",
            *sampling,
            f"reward.custom_reward_function.path={v(self.reward_file)}",
            f"reward.custom_reward_function.name={v(self.reward_function)}",
            *(f"+reward.custom_reward_function.reward_kwargs.{key}={v(value)}"
              for key, value in (("urls", self.reward_urls), ("expect_reward", self.reward),
                                 ("expect_sim_weight", self.expected_sim_weight),
                                 ("expect_mos_weight", self.mos_weight),
                                 # the budget tells the reward function an unfinished response (client.is_finished)
                                 ("max_response_length", self.max_response_length)) if value is not None),
            f"reward.reward_manager.name={self.reward_manager}",
            "algorithm.use_kl_in_reward=False",
            f"algorithm.rollout_correction.bypass_mode={v(self.bypass_old_log_prob)}",
            *self.algorithm_overrides(),
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
        if self.seed is not None:
            out += [f"data.seed={self.seed}", f"{ar}.rollout.seed={self.seed}"]
        if self.total_training_steps is not None:
            out.append(f"trainer.total_training_steps={self.total_training_steps}")
        return out

    def algorithm_overrides(self) -> list[str]:
        """``ALGORITHMS[algorithm]`` for this run's response budget, then ``norm_adv_by_std`` when set."""
        overlong = max(1, round(self.max_response_length * DAPO_OVERLONG_SHARE))
        out = [o.format(max_response_length=self.max_response_length, overlong_buffer=overlong)
               for o in ALGORITHMS[self.algorithm]]
        if self.norm_adv_by_std is not None:
            out.append(f"algorithm.norm_adv_by_std_in_grpo={_hydra_value(self.norm_adv_by_std)}")
        return out

    def cpu_overrides(self) -> list[str]:
        """What a CPU-only machine needs (see ``ttsrl.verl_plugin``); used with ``cpu_env()``."""
        ar = "actor_rollout_ref"
        # a local Ray's logical resources; an attached cluster has its own (Ray raises on these)
        local_ray = [] if self.ray_address else [
            f"+ray_kwargs.ray_init.num_gpus={self.n_gpus_per_node}",  # logical GPUs for verl's resource pools
            "ray_kwargs.ray_init.num_cpus=32",  # logical: actors must not starve on a small CPU machine
        ]
        return [
            "trainer.device=cpu",
            *local_ray,
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            f"{ar}.actor.strategy=fsdp2",
            f"{ar}.ref.strategy=fsdp2",
            f"{ar}.actor.use_torch_compile=False",
            f"{ar}.ref.use_torch_compile=False",
            f"{ar}.actor.fsdp_config.use_torch_compile=False",
            f"{ar}.ref.fsdp_config.use_torch_compile=False",
            f"+{ar}.model.override_config.attn_implementation=eager",  # no flash-attn
            # padded micro-batches: verl's packed sequences (use_remove_padding=True) work here (its
            # pure-torch unpad; eager attention separates packed sequences by their position ids) but
            # were slower: eager attention over a packed micro-batch is quadratic in its total length.
            # Interleaved 7-step trials (2026-12-02, docs/results.md): update 5.75 s packed, 4.8 s padded
            f"{ar}.model.use_remove_padding=False",
            f"{ar}.rollout.dtype=float32",
            # fp32 compute in actor and ref, as in the fp32 hf rollout (verl's default is bf16
            # autocast: slower on most CPUs and ~1e-2 apart from the rollout's probabilities)
            *(f"+{ar}.{role}.fsdp_config.mixed_precision.{k}=fp32" for role in ("actor", "ref")
              for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
            f"{ar}.rollout.calculate_log_probs=True",  # rollout vs actor log-prob metrics
            # one of each per node (verl spreads them round-robin over the nodes; ttsrl.train.cluster)
            f"{ar}.rollout.agent.num_workers={cluster.worker_count(self.nnodes, 1)}",
            f"reward.num_workers={cluster.worker_count(self.nnodes, 1)}",
            "data.dataloader_num_workers=0",
        ]

    def cluster_overrides(self, environ: Mapping[str, str]) -> list[str]:
        """A multi-node run's: the cluster to attach to, reward and agent-loop workers on every
        node, and the variables every node's workers need (``ttsrl.train.cluster``)."""
        if not self.multi_node:
            return []
        out = [f"+ray_kwargs.ray_init.address={cluster.hydra_quote(self.ray_address)}"] if self.ray_address else []
        if self.device == "gpu" and self.nnodes > 1:  # verl's defaults are one node's (cpu_overrides: its own)
            n = cluster.worker_count(self.nnodes, cluster.VERL_DEFAULT_WORKERS)
            out += [f"actor_rollout_ref.rollout.agent.num_workers={n}", f"reward.num_workers={n}"]
        return out + cluster.env_var_overrides(self.forwarded_env(environ))

    def to_overrides(self, environ: Optional[Mapping[str, str]] = None, raw: bool = True) -> list[str]:
        """The ``verl.trainer.main_ppo`` overrides; ``environ`` (default ``os.environ``) is the
        environment the run starts from, read by a multi-node run only (forwarded variables);
        ``raw``: the raw overrides (``extra``) last."""
        environ = os.environ if environ is None else environ
        out = self.recipe_overrides()
        if self.device == "cpu":
            out += self.cpu_overrides()
        return out + self.cluster_overrides(environ) + (list(self.extra) if raw else [])

    def forwarded_env(self, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """What a multi-node run forwards to every worker (``ttsrl.train.cluster.forwarded_env``
        of ``environ`` with ``env()`` over it); empty on one node."""
        environ = os.environ if environ is None else environ
        return cluster.forwarded_env(environ, self.env(environ)) if self.multi_node else {}

    def env(self, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """Environment the run needs (plugin import path, CPU platform) on top of ``environ``
        (default ``os.environ``)."""
        from ttsrl.verl_plugin import PLUGIN_MODULE, cpu_env

        environ = os.environ if environ is None else environ
        env = cpu_env(environ) if self.device == "cpu" else {"VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE}
        if self.ray_address and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in environ:
            # the loopback-only switch of a local CPU run would make this node unreachable
            env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        path = environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
        return env

