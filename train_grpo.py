#!/usr/bin/env python
"""Stage 2: GRPO training through verl 0.9.1 (``python -m verl.trainer.main_ppo``).

Every field of ``ttsrl.train.grpo.GRPOConfig`` is an option (``--train-batch-size 32``),
with the help declared on the field. ``--preset`` picks the values they start from
(``PRESETS`` in ttsrl/train/grpo.py: ``gpu8`` the 8-GPU recipe, ``embedded`` the CPU run
of presets/embedded.sh, ``gpu``/``cpu`` the bare paths); options given here win over the
preset. ``cpu`` runs through our verl plugin ``ttsrl.verl_plugin`` (the ``hf`` rollout,
one logical GPU). Any verl Hydra override can follow ``--`` and is applied last, e.g.

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
import os
import shlex
import sys

from ttsrl.cli import add_fields, given
from ttsrl.train.grpo import PRESETS, GRPOConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shown = "; ".join(f"{name}: " + (", ".join(f"{k}={v}" for k, v in values.items()) or "the field defaults")
                      for name, values in PRESETS.items())
    p.add_argument("--preset", choices=tuple(PRESETS), default="gpu",
                   help=f"field values the options below start from (ttsrl/train/grpo.py PRESETS) - {shown} "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print env and command, do not run")
    add_fields(p.add_argument_group("settings (GRPOConfig; given here, they win over the preset)"), GRPOConfig)
    return p


def build(argv: list[str]) -> tuple[GRPOConfig, list[str], dict[str, str]]:
    """argv -> (config, command, extra environment)."""
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    cfg = GRPOConfig.from_preset(args.preset, **given(args, GRPOConfig), extra=extra)
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
