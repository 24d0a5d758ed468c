#!/usr/bin/env python
"""Stage 2: GRPO training through verl 0.9.1 (``python -m verl.trainer.main_ppo``).

Every field of ``ttsrl.grpo.GRPOConfig`` is an option (``--train-batch-size 32``);
``--preset cpu`` selects the embedded CPU path (our verl plugin ``ttsrl.verl_cpu``,
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

from ttsrl.grpo import ALGORITHMS, DEVICES, GRPOConfig

REQUIRED = ("model_path", "train_files", "val_files")


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
        kw["help"] = f"(default: {default})" if default is not None else ""
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
