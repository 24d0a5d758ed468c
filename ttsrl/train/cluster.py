"""Attaching stage 2 to a running Ray cluster: what the workers on every node must be told.

A GRPO run is *multi-node* when ``GRPOConfig.nnodes > 1`` or ``GRPOConfig.ray_address`` is
set (``train_grpo.py --ray-address HOST:PORT``, default ``$RAY_ADDRESS``). verl 0.9.1 then
calls ``ray.init(address=...)`` and attaches instead of starting a local Ray; Ray refuses
``num_cpus``/``num_gpus`` when attaching, so those overrides are left out.

**Environment.** A Ray worker inherits the environment of the ``ray start`` that started
its raylet, not the driver's: on another node our plugin switch, ``PYTHONPATH`` and the
reward URLs are simply absent (verl would not load ``ttsrl.verl_plugin`` and the reward
client would call its default URL). :func:`forwarded_env` picks the variables the workers
need from the environment the verl driver gets (the caller's environment with
``GRPOConfig.env()`` over it); :func:`env_var_overrides` renders them as
``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=VALUE``, which verl merges over its own
defaults and passes to ``ray.init``: the job's runtime environment, applied to every worker
on every node. Forwarded:

* names starting with one of ``FORWARD_PREFIXES``: ``TTSRL_`` (our knobs: reward URLs, the
  ``hf`` rollout's settings), ``VERL_`` (the plugin switch ``VERL_USE_EXTERNAL_MODULES``,
  ``VERL_PLATFORM``...), ``HF_``, ``TRANSFORMERS_``, ``TORCH_``, ``NCCL_``, ``GLOO_``, ``VLLM_``,
  ``WANDB_``, ``TQ_`` (TransferQueue);
* the names in ``FORWARD_NAMES``: ``PYTHONPATH`` (``ttsrl`` importable where verl imports the
  plugin), ``TENSORBOARD_DIR``, ``TOKENIZERS_PARALLELISM``, ``OMP_NUM_THREADS``,
  ``MKL_NUM_THREADS``, ``PYTORCH_CUDA_ALLOC_CONF``, ``RAY_AUTH_MODE``.

Never forwarded:

* device visibility (``NEVER``: ``CUDA_VISIBLE_DEVICES``, ``ROCR_``/``HIP_VISIBLE_DEVICES``,
  ``ASCEND_RT_VISIBLE_DEVICES``): Ray sets it per worker from the GPUs it assigns;
* names that look secret (:func:`looks_secret`: a ``_``-separated word ``TOKEN``, ``KEY``,
  ``SECRET``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL(S)``; e.g. ``WANDB_API_KEY``,
  ``HF_TOKEN``): verl prints its ``ray.init`` arguments to the log and ``train_grpo.py``
  records the overrides in ``ttsrl_run.json``. Export those on every node before
  ``ray start`` instead: a raylet's workers inherit the environment of ``ray start``
  (:func:`withheld_secrets` names the ones left behind);
* any other ``RAY_*`` (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is the single-node CPU run's and
  is not set at all when attaching) and names Hydra cannot take as a key.

Values pass through Hydra's override grammar and OmegaConf exactly (:func:`hydra_quote`),
``:`` ``,`` ``=`` ``/`` quotes, backslashes and ``$`` included, except ``${``: OmegaConf reads
it as an interpolation even when escaped (``OmegaConf.resolve`` un-escapes it and parses it
again), so such a value is refused with its name.

**Paths.** Workers resolve relative paths against their own working directory, on their
own machine: a multi-node run refuses relative ``RELATIVE_PATH_FIELDS``
(``GRPOConfig.__post_init__``).

**Workers.** verl places its ``RewardLoopWorker`` and agent-loop workers round-robin over
the alive nodes (``reward.num_workers``, ``actor_rollout_ref.rollout.agent.num_workers``,
8 each by default): ``worker_count`` keeps the per-node count a single-node run has (1 on
the CPU path, verl's 8 on GPU) on every node, so each node calls its reward function
from as many workers as one node alone would.
"""

from __future__ import annotations

import re
from typing import Mapping

FORWARD_PREFIXES = ("TTSRL_", "VERL_", "HF_", "TRANSFORMERS_", "TORCH_", "NCCL_", "GLOO_", "VLLM_", "WANDB_",
                    "TQ_")
FORWARD_NAMES = frozenset({"PYTHONPATH", "TENSORBOARD_DIR", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS",
                           "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "RAY_AUTH_MODE"})
NEVER = frozenset({"CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                   "ASCEND_RT_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})
SECRET_WORDS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"})
RELATIVE_PATH_FIELDS = ("model_path", "train_files", "val_files", "checkpoint_dir", "reward_file")
ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
VERL_DEFAULT_WORKERS = 8  # reward.num_workers and rollout.agent.num_workers in verl 0.9.1's ppo_trainer.yaml

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def looks_secret(name: str) -> bool:
    """True for a name with a ``_``-separated word in ``SECRET_WORDS`` (``HF_TOKEN``,
    ``WANDB_API_KEY``; not ``TOKENIZERS_PARALLELISM``)."""
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def _wanted(name: str) -> bool:
    return name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)


def forwarded_env(environ: Mapping[str, str], run_env: Mapping[str, str]) -> dict[str, str]:
    """The variables Ray workers on every node get: the forwarded names of ``environ`` with
    ``run_env`` (``GRPOConfig.env()``) over it, sorted by name. Raises ``ValueError`` naming a
    variable whose value holds ``${``."""
    merged = {**environ, **run_env}
    out = {}
    for name in sorted(merged):
        if name in NEVER or looks_secret(name) or not _wanted(name) or not _NAME.fullmatch(name):
            continue
        value = merged[name]
        if "${" in value:
            raise ValueError(f"environment variable {name}={value!r} holds '${{', which verl's config (OmegaConf) "
                             "reads as an interpolation: unset it, or export it on every node before `ray start`")
        out[name] = value
    return out


def withheld_secrets(environ: Mapping[str, str]) -> list[str]:
    """Names that would be forwarded but look secret: to be exported on every node instead."""
    return sorted(n for n in environ if _wanted(n) and looks_secret(n) and n not in NEVER)


def hydra_quote(value: str) -> str:
    """``value`` as a single-quoted Hydra override value that verl's config reads back as
    exactly ``value`` (Hydra unescapes backslashes only before a quote or at the end of a
    quoted value). ``${`` cannot be carried (see the module docstring)."""
    if "${" in value:
        raise ValueError(f"{value!r}: '${{' cannot pass through verl's config (an OmegaConf interpolation)")
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"'{body}'"


def env_var_overrides(forwarded: Mapping[str, str]) -> list[str]:
    """``+ray_kwargs.ray_init.runtime_env.env_vars.NAME='VALUE'`` for each forwarded variable."""
    return [f"+{ENV_VARS_KEY}.{name}={hydra_quote(value)}" for name, value in forwarded.items()]


def forwarded_names(overrides: list[str]) -> list[str]:
    """The variable names ``overrides`` forward (those :func:`env_var_overrides` rendered)."""
    head = f"+{ENV_VARS_KEY}."
    return [o[len(head):].split("=", 1)[0] for o in overrides if o.startswith(head)]


def worker_count(nnodes: int, per_node: int) -> int:
    """reward / agent-loop workers for ``nnodes`` nodes: ``per_node`` on each (verl spreads them
    round-robin over the alive nodes)."""
    return per_node * nnodes


def relative_paths(values: Mapping[str, str]) -> list[tuple[str, str]]:
    """(field, value) of each ``RELATIVE_PATH_FIELDS`` value that is a relative local path
    (a URL such as ``hdfs://...`` is not a local path)."""
    from pathlib import PurePosixPath

    return [(f, values[f]) for f in RELATIVE_PATH_FIELDS
            if values.get(f) and "://" not in values[f] and not PurePosixPath(values[f]).is_absolute()]
