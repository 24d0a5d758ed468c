#!/usr/bin/env python
"""Stage 2: GRPO training through verl 0.9.1 (``python -m verl.trainer.main_ppo``).

Every field of ``ttsrl.train.grpo.GRPOConfig`` is an option (``--train-batch-size 32``);
``--preset cpu`` selects the embedded CPU path (our verl plugin ``ttsrl.verl_plugin``,
the ``hf`` rollout, one logical GPU). Any verl Hydra override can follow ``--`` and
is applied last, e.g.

    python train_grpo.py --preset cpu --model-path exp/hf_model \\
        --train-files data/train.parquet --val-files data/test.parquet \\
        --checkpoint-dir exp/checkpoints --total-training-steps 30 --save-freq 10 \\
        -- actor_rollout_ref.actor.optim.lr=1e-5 trainer.val_before_train=False

The run resumes from the newest ``global_step_N`` in ``--checkpoint-dir``
(``trainer.resume_mode=auto``). ``--dry-run`` prints the environment and command
instead of running. The process is replaced by verl's (signals reach it directly).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import typing

from ttsrl.train.grpo import ALGORITHMS, DEVICES, GRPOConfig

REQUIRED = ("model_path", "train_files", "val_files")

# What each GRPOConfig field means (the --help text); the verl key it sets is in ttsrl/train/grpo.py.
HELP = {
    "model_path": "the Hugging Face checkpoint to train (stage -1's hf_model/ or a merged step)",
    "train_files": "training Parquet from stage 0 (train.parquet)",
    "val_files": "validation Parquet from stage 0 (test.parquet)",
    "checkpoint_dir": "where verl writes global_step_N/ (and resumes from)",
    "reward_file": "Python file holding the reward function verl calls",
    "reward_function": "name of the reward function in --reward-file",
    "reward_manager": "verl reward manager (naive: one call per response, batched by the server)",
    "algorithm": "advantage/loss preset (see ALGORITHMS in ttsrl/train/grpo.py)",
    "train_batch_size": "prompts per training step",
    "ppo_mini_batch_size": "prompts per optimiser update (<= --train-batch-size)",
    "micro_batch_size_per_gpu": "sequences per forward/backward pass on one GPU",
    "lr": "actor learning rate",
    "max_prompt_length": "prompt budget in tokens (longer prompts are dropped by verl)",
    "max_response_length": "most speech tokens generated per response",
    "use_kl_loss": "add a KL penalty to the reference model to the loss",
    "gradient_checkpointing": "recompute activations in the backward pass (less memory, slower)",
    "rollout": "generation engine: vllm (GPU) or hf (transformers, the CPU preset)",
    "tensor_parallel_size": "GPUs per vLLM rollout engine",
    "gpu_memory_utilization": "fraction of GPU memory vLLM may take",
    "n": "responses sampled per prompt (the GRPO group size)",
    "temperature": "rollout sampling temperature",
    "top_p": "rollout nucleus sampling threshold",
    "top_k": "rollout top-k sampling (CosyVoice2 samples with 25)",
    "total_epochs": "passes over the training data",
    "total_training_steps": "stop after this many steps (default: epochs x batches)",
    "save_freq": "save a checkpoint every N steps",
    "test_freq": "validate every N steps",
    "val_before_train": "validate once before the first step",
    "resume_mode": "verl resume mode: auto (newest global_step_N), disable, resume_path",
    "n_gpus_per_node": "GPUs per node (the CPU preset uses 1 logical GPU)",
    "nnodes": "nodes in the Ray cluster",
    "project_name": "project name for the loggers",
    "experiment_name": "experiment name for the loggers (and verl's folders)",
    "loggers": "comma-separated: console, wandb, tensorboard",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=DEVICES, default="gpu",
                   help="gpu: the 8-GPU recipe (vLLM rollouts); cpu: embedded CPU path (hf rollout)")
    p.add_argument("--dry-run", action="store_true", help="print env and command, do not run")
    hints = typing.get_type_hints(GRPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        if f.name in ("extra", "device"):
            continue
        opt = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        default = None if f.default is dataclasses.MISSING else f.default
        kw: dict = {"dest": f.name, "default": None}
        if f.name in REQUIRED:
            kw["required"] = True
        if hint is bool:
            kw["type"] = lambda s: s.lower() in ("1", "true", "yes", "on")
            kw["metavar"] = "BOOL"
        elif f.name == "loggers":
            kw["type"] = lambda s: tuple(x for x in s.split(",") if x)
            kw["metavar"] = "console[,wandb][,tensorboard]"
        elif f.name == "algorithm":
            kw["choices"] = sorted(ALGORITHMS)
        else:
            base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kw["type"] = base[0]
        if "metavar" not in kw and "choices" not in kw:
            kw["metavar"] = kw["type"].__name__.upper()
        shown = "required" if f.name in REQUIRED else f"default: {default}"
        kw["help"] = f"{HELP[f.name]} ({shown})"
        p.add_argument(opt, **kw)
    return p


def build(argv: list[str]) -> tuple[GRPOConfig, list[str], dict[str, str]]:
    """argv -> (config, command, extra environment)."""
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    values = {k: v for k, v in vars(args).items() if v is not None and k not in ("preset", "dry_run")}
    values["extra"] = extra
    cfg = GRPOConfig.cpu_preset(**values) if args.preset == "cpu" else GRPOConfig(**values)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *cfg.to_overrides()]
    return cfg, command, cfg.env()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg, command, env = build(argv)
    dry = "--dry-run" in argv[: argv.index("--")] if "--" in argv else "--dry-run" in argv
    if dry:
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")
        print(" \\\n  ".join(shlex.quote(c) for c in command))
        return
    print(f"[train_grpo] checkpoints -> {cfg.checkpoint_dir} (resume_mode={cfg.resume_mode})", flush=True)
    print("[train_grpo] verl command: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " "
          + shlex.join(command), flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    main()
