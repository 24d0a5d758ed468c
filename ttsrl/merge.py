"""Stage 3: merge every saved FSDP step into a Hugging Face checkpoint.

For each ``CKPT/global_step_N/actor`` this runs verl's own merger

    python -m verl.model_merger merge --backend fsdp --local_dir .../actor --target_dir ...

and leaves ``OUT/step_N`` in the layout the converter writes: weights, config,
tokenizer, generation_config, our modeling file (the class keeping the lm_head
bias, named by ``auto_map``) and the converter's side file, so stages 4 and 5 load
it exactly like the converted base model.

Why the extra copies: verl's checkpoint saver does not copy the modeling file into
``actor/huggingface/`` (it copies files of the FSDP wrapper instead), and the merger
needs it there to load the class with ``--trust-remote-code``; transformers does
not copy remote code for a known ``model_type`` (qwen2) when saving, so the merged
folder gets it afterwards.

Idempotent: a finished step carries ``MARKER`` (written last); it is skipped. A
step is merged into a temporary folder and renamed into place, so an interrupted
merge leaves no ``step_N`` and is simply redone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .atomic import atomic_dir
from .convert import EXTRA_FILE, MODELING_FILE

STEP_RE = re.compile(r"^global_step_(\d+)$")
MARKER = "MERGED.json"
HF_SUBDIR = "huggingface"
# files of the HF layout the merger may not write; copied from actor/huggingface
LAYOUT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                "generation_config.json", "added_tokens.json", "vocab.json", "merges.txt")


class MergeError(RuntimeError):
    pass


@dataclass
class MergeConfig:
    ckpt_dir: Path
    out_dir: Path
    base_model: Optional[Path] = None  # the converted model: source of modeling and side files
    steps: Optional[list[int]] = None  # None: every saved step
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class StepResult:
    step: int
    path: Path
    merged: bool  # False: already merged, skipped
    seconds: float = 0.0


def saved_steps(ckpt_dir: Path) -> dict[int, Path]:
    """{N: CKPT/global_step_N/actor} for every step whose actor shards exist."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise MergeError(f"checkpoint folder {ckpt_dir} does not exist")
    steps = {}
    for d in ckpt_dir.iterdir():
        m = STEP_RE.match(d.name)
        actor = d / "actor"
        if m and actor.is_dir() and any(actor.glob("model_world_size_*_rank_*.pt")):
            steps[int(m.group(1))] = actor
    return dict(sorted(steps.items()))


def is_merged(step_dir: Path) -> bool:
    return (step_dir / MARKER).is_file()


def _remote_code_modules(hf_config: dict) -> list[str]:
    """File names of the modules ``auto_map`` points at (``modeling_x.Class`` -> ``modeling_x.py``)."""
    names = []
    for ref in (hf_config.get("auto_map") or {}).values():
        ref = ref[-1] if isinstance(ref, list) else ref
        if "--" in ref:  # "repo--module.Class": remote repo reference, not a local file
            ref = ref.split("--", 1)[1]
        names.append(ref.rsplit(".", 1)[0] + ".py")
    return sorted(set(names))


def _find_module(name: str, search: list[Path]) -> Path:
    for d in search:
        if d is not None and (d / name).is_file():
            return d / name
    if MODELING_FILE.name == name:
        return MODELING_FILE
    raise MergeError(f"config.json auto_map names {name}, found in none of "
                     f"{[str(d) for d in search if d is not None]} nor in the ttsrl package")


def prepare_actor_dir(actor: Path, base_model: Optional[Path]) -> tuple[bool, list[Path]]:
    """Put the remote-code modules next to ``actor/huggingface/config.json``.

    Returns (uses remote code, module files)."""
    hf = actor / HF_SUBDIR
    cfg_path = hf / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{cfg_path} missing: is {actor} a verl FSDP actor checkpoint?")
    cfg = json.loads(cfg_path.read_text())
    modules = [_find_module(n, [hf, base_model]) for n in _remote_code_modules(cfg)]
    for src in modules:
        if src.parent != hf:
            shutil.copy2(src, hf / src.name)
    return bool(modules), modules


def merge_step(step: int, actor: Path, out_dir: Path, cfg: MergeConfig,
               log: Callable[[str], None] = print) -> StepResult:
    target = out_dir / f"step_{step}"
    if is_merged(target):
        return StepResult(step, target, merged=False)
    t0 = time.time()
    remote, modules = prepare_actor_dir(actor, cfg.base_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f".step_{step}.tmp-*"):  # left by a merge that was killed
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(target) as tmp:  # an interrupted merge leaves no step_N
        cmd = [cfg.python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
               "--local_dir", str(actor), "--target_dir", str(tmp)]
        if remote:
            cmd.append("--trust-remote-code")
        log(f"[merge] step {step}: {' '.join(cmd)}")
        env = {**os.environ, **cfg.extra_env}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise MergeError(f"verl.model_merger failed for {actor} (exit {proc.returncode}):\n"
                             + proc.stdout[-4000:])
        hf = actor / HF_SUBDIR
        for src in modules:  # the class keeping the lm_head bias
            shutil.copy2(src, tmp / src.name)
        for name in LAYOUT_FILES:  # tokenizer + generation config, when the merger left them out
            if (hf / name).is_file() and not (tmp / name).exists():
                shutil.copy2(hf / name, tmp / name)
        if cfg.base_model is not None and (cfg.base_model / EXTRA_FILE).is_file():
            (tmp / EXTRA_FILE).parent.mkdir(exist_ok=True)
            shutil.copy2(cfg.base_model / EXTRA_FILE, tmp / EXTRA_FILE)
        marker = {"step": step, "source": str(actor.resolve()), "remote_code": [m.name for m in modules],
                  "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))  # last: marks completion
    return StepResult(step, target, merged=True, seconds=time.time() - t0)


def merge_all(cfg: MergeConfig, log: Callable[[str], None] = print) -> list[StepResult]:
    steps = saved_steps(cfg.ckpt_dir)
    if cfg.steps is not None:
        missing = sorted(set(cfg.steps) - set(steps))
        if missing:
            raise MergeError(f"steps {missing} not saved in {cfg.ckpt_dir} (saved: {sorted(steps)})")
        steps = {s: steps[s] for s in cfg.steps}
    if not steps:
        raise MergeError(f"no global_step_N/actor checkpoints in {cfg.ckpt_dir}")
    results = []
    for step, actor in steps.items():
        r = merge_step(step, actor, Path(cfg.out_dir), cfg, log=log)
        log(f"[merge] step {step}: {'merged in %.1f s' % r.seconds if r.merged else 'already merged, skipped'}"
            f" -> {r.path}")
        results.append(r)
    return results
