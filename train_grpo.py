#!/usr/bin/env python
"""Stage 2: GRPO training through verl 0.9.1 (``python -m verl.trainer.main_ppo``).

Every field of ``ttsrl.train.grpo.GRPOConfig`` is an option (``--train-batch-size 32``),
with the help declared on the field. ``--preset`` picks the values they start from
(``PRESETS`` in ttsrl/train/grpo.py: ``gpu8`` the 8-GPU recipe, ``embedded`` the CPU run
of presets/embedded.sh, ``gpu``/``cpu`` the bare paths); options given here win over the
preset. ``cpu`` runs through our verl plugin ``ttsrl.verl_plugin`` (the ``hf`` rollout,
one logical GPU per ``--n-gpus-per-node``, each an FSDP rank). Any verl Hydra override can follow ``--`` and is applied last, e.g.

    python train_grpo.py --preset cpu --model-path exp/hf_model \\
        --train-files data/train.parquet --val-files data/test.parquet \\
        --checkpoint-dir exp/checkpoints --total-training-steps 30 --save-freq 10 \\
        --lr 1e-5 --val-before-train false -- actor_rollout_ref.actor.optim.weight_decay=0.0

On several nodes, start Ray on each (``ray start``) and attach: ``--ray-address HOST:PORT``
(default ``$RAY_ADDRESS``) with ``--nnodes N``. The workers on every node then get the
variables they need through Ray's runtime environment (``TTSRL_*`` reward URLs, our plugin
switch, ``PYTHONPATH``, ``HF_*``, ``NCCL_*``...: ttsrl/train/cluster.py); secrets
(``WANDB_API_KEY``, ``HF_TOKEN``...) are not forwarded: export them on every node before
``ray start``. Paths must be absolute, on a filesystem every node mounts.

The run resumes from the newest ``global_step_N`` in ``--checkpoint-dir``
(``trainer.resume_mode=auto``; an empty tracker or one naming a partial step, left by a crash
while verl saved, is first repaired to the newest complete step: ttsrl/train/verl_ckpt.py).
Before verl starts, ``<checkpoint-dir>/ttsrl_run.json`` records the settings, the preset, the
``TTSRL_*`` knobs in effect (ttsrl/knobs.py), the reward asked for (``--reward``,
``--reward-backend``) with the servers (``--reward-urls``) and the model metadata each serves
(a server serving another reward or backend stops the run before verl starts), the names of the variables forwarded to the
workers, the verl overrides and the step resumed from, and keeps every earlier launch's record
(``earlier_launches``). ``--dry-run`` prints the environment and command instead of running
(and writes nothing). The process is replaced by verl's (signals reach it directly).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Mapping, NamedTuple

from ttsrl import knobs
from ttsrl.atomic import atomic_write_text
from ttsrl.cli import add_fields, given
from ttsrl.train import cluster
from ttsrl.train.grpo import PRESETS, GRPOConfig
from ttsrl.train.verl_ckpt import repair_tracker

RUN_RECORD = "ttsrl_run.json"  # in --checkpoint-dir: what the latest launch ran with (and the earlier ones)


class Run(NamedTuple):
    config: GRPOConfig
    command: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    preset: str
    dry_run: bool


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: the flags run.sh and its checks own are whole words; an abbreviation would slip past them
    p = argparse.ArgumentParser(allow_abbrev=False, prog="train_grpo.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    shown = "; ".join(f"{name}: " + (", ".join(f"{k}={v}" for k, v in values.items()) or "the field defaults")
                      for name, values in PRESETS.items())
    p.add_argument("--preset", choices=tuple(PRESETS), default="gpu",
                   help=f"field values the options below start from (ttsrl/train/grpo.py PRESETS) - {shown} "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print env and command, do not run")
    add_fields(p.add_argument_group("settings (GRPOConfig; given here, they win over the preset)"), GRPOConfig)
    return p


def build(argv: list[str], environ: Mapping[str, str] | None = None) -> Run:
    """argv -> the run: config, verl command, extra environment, preset name, dry run or not.
    ``environ`` (default ``os.environ``): the environment the run starts from (``RAY_ADDRESS``,
    the variables a multi-node run forwards)."""
    environ = os.environ if environ is None else environ
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    values = given(args, GRPOConfig)
    if "ray_address" not in values and environ.get("RAY_ADDRESS"):
        values["ray_address"] = environ["RAY_ADDRESS"]
    cfg = GRPOConfig.from_preset(args.preset, **values, extra=extra)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *cfg.to_overrides(environ)]
    return Run(cfg, command, cfg.env(environ), args.preset, args.dry_run)


def forwarding_note(run: Run, environ: Mapping[str, str]) -> str:
    """One line naming what a multi-node run forwards to every node's workers (and the
    secrets it leaves to each node's own environment); empty on one node."""
    if not run.config.multi_node:
        return ""
    names = cluster.forwarded_names(run.command)
    note = f"[train_grpo] attaching to {run.config.ray_address or 'a local Ray'} ({run.config.nnodes} node(s)); " \
           f"forwarded to every node's workers: {', '.join(names) or 'nothing'}"
    secrets = cluster.withheld_secrets(environ)
    if secrets:
        note += f"; not forwarded (export on every node before `ray start`): {', '.join(secrets)}"
    return note


def reward_record(cfg: GRPOConfig, environ: Mapping[str, str]) -> tuple[dict, list[str]]:
    """What this run trains on: the reward variant and backend asked for, the servers and the
    model metadata each serves (``error`` where it gave none); and a sentence per server that
    serves another reward or backend than asked."""
    from ttsrl.reward.health import identity_mismatches, metadata
    from ttsrl.reward.protocol import DEFAULT_URL, split_urls

    urls = split_urls(cfg.reward_urls or environ.get("TTSRL_REWARD_URL") or DEFAULT_URL)
    expect = {k: str(v) for k, v in (("reward", cfg.reward), ("backend", cfg.reward_backend),
                                     ("sim_weight", cfg.expected_sim_weight), ("mos_weight", cfg.mos_weight))
              if v is not None}
    served, problems = {}, []
    for url in urls:
        try:
            served[url] = meta = metadata(url)
        except Exception as e:  # down now: the client fails over, and the launcher waited for it
            served[url] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        wrong = identity_mismatches(meta, expect)
        if wrong:
            problems.append(f"the reward server at {url} serves {', '.join(wrong)} (--reward, --reward-backend, "
                            "--sim-weight / --reward-weights, --mos-weight)")
    return {"reward": cfg.reward, "backend": cfg.reward_backend, "sim_weight": cfg.expected_sim_weight,
            "mos_weight": cfg.mos_weight, "reward_weights": cfg.reward_weights, "gdpo_reward_keys": gdpo_keys(cfg),
            "urls": list(urls), "served": served}, problems


def gdpo_keys(cfg: GRPOConfig) -> list[str] | None:
    """The reward components ``--algorithm gdpo`` trains on (None for another algorithm)."""
    for o in cfg.algorithm_overrides() + list(cfg.extra):
        if o.lstrip("+").startswith("algorithm.gdpo_reward_keys="):
            return o.split("=", 1)[1].strip("[]").split(",")
    return None


def write_run_record(run: Run, environ: Mapping[str, str], resumes_from: int | None = None,
                     reward: dict | None = None) -> Path:
    """``<checkpoint_dir>/ttsrl_run.json`` (atomic): this launch's settings, preset, TTSRL_* knobs
    in ``environ`` (the environment verl gets), the names (not the values) of the variables
    forwarded to every node's workers, the verl overrides, when it started and the step it
    resumes from; at the top level, so the record reads as the latest launch. Every earlier
    launch of the same checkpoint folder stays in ``earlier_launches`` (oldest first): a resumed
    run keeps the settings its first steps were trained with."""
    path = Path(run.config.checkpoint_dir) / RUN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier: list = []
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, UnicodeError, ValueError) as e:
            old = {"unreadable_record": f"{type(e).__name__}: {e}"[:300]}
        if isinstance(old, dict):
            earlier = list(old.pop("earlier_launches", [])) + [old]
    record = {"preset": run.preset, "config": dataclasses.asdict(run.config), "knobs": knobs.in_effect(environ),
              "reward": reward, "env": run.env, "forwarded_env": cluster.forwarded_names(run.command),
              "verl_overrides": run.command[3:], "launched_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "resumes_from_step": resumes_from, "earlier_launches": earlier}
    atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run = build(argv)
    cfg, command, env = run.config, run.command, run.env
    note = forwarding_note(run, os.environ)
    if run.dry_run:
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")
        if note:
            print("# " + note)
        print(" \\\n  ".join(shlex.quote(c) for c in command))
        return
    environ = {**os.environ, **env}
    # a crash while verl saved can leave an empty tracker or one naming a partial step: verl's
    # resume would stop on int('') -- repaired to the newest complete step, with a message
    reward, problems = reward_record(cfg, environ)
    if problems:  # before verl: a run never trains on another reward than it asked for
        sys.exit("[train_grpo] " + "\n[train_grpo] ".join(problems))
    resumes = repair_tracker(Path(cfg.checkpoint_dir)) if cfg.resume_mode == "auto" else None
    record = write_run_record(run, environ, resumes, reward)
    if note:
        print(note, flush=True)
    print(f"[train_grpo] checkpoints -> {cfg.checkpoint_dir} (resume_mode={cfg.resume_mode}); settings, "
          f"knobs and overrides -> {record}", flush=True)
    print("[train_grpo] verl command: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " "
          + shlex.join(command), flush=True)
    os.execvpe(command[0], command, environ)


if __name__ == "__main__":
    main()
