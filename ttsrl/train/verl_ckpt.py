"""verl 0.9.1's FSDP checkpoint folder: which saved steps are complete, and its tracker file.

verl's trainer saves ``CKPT/global_step_N/actor/`` (``model_world_size_W_rank_R.pt`` for every
rank R, ``optim_*``, ``extra_state_*``, ``fsdp_config.json``, ``huggingface/``), then writes
``CKPT/latest_checkpointed_iteration.txt`` (the tracker: N, plain text, written in place) and
resumes from the step the tracker names (``find_latest_ckpt_path``, which does ``int()`` of the
file). A crash while saving leaves a ``global_step_N`` newer than the tracker, with some files
missing; a crash while writing the tracker leaves it empty. So:

* :func:`saved_steps` lists the complete, tracked steps, and names each folder it leaves out and
  why (stage 3 merges the rest instead of failing on the first partial one);
* :func:`repair_tracker` rewrites an empty or unreadable tracker, or one naming a step that is
  not complete, with the newest complete step (atomically, with a message), so stage 2 resumes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from ttsrl.atomic import atomic_write_text

STEP_RE = re.compile(r"^global_step_(\d+)$")  # verl's FSDP checkpoints (the merged ones: checkpoint.STEP_RE)
SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
TRACKER = "latest_checkpointed_iteration.txt"  # verl's name (verl.utils.checkpoint)
HF_SUBDIR = "huggingface"


def shard_files(actor: Path) -> list[Path]:
    """The FSDP model shards of ``actor`` (``model_world_size_W_rank_R.pt``), sorted."""
    return sorted(p for p in actor.iterdir() if SHARD_RE.match(p.name)) if actor.is_dir() else []


def step_problem(actor: Path) -> str | None:
    """Why ``global_step_N/actor`` is not a complete FSDP checkpoint (None: it is): verl's
    ``fsdp_config.json``, the model config and one model shard per rank of one world size."""
    if not actor.is_dir():
        return "no actor/ folder"
    if not (actor / "fsdp_config.json").is_file():
        return "no fsdp_config.json (verl did not finish saving it)"
    if not (actor / HF_SUBDIR / "config.json").is_file():
        return f"no {HF_SUBDIR}/config.json"
    shards = [SHARD_RE.match(p.name) for p in shard_files(actor)]
    sizes = {int(m.group(1)) for m in shards}
    if len(sizes) != 1:
        return "no model shards" if not sizes else f"model shards of several world sizes {sorted(sizes)}"
    (world,) = sizes
    missing = sorted(set(range(world)) - {int(m.group(2)) for m in shards})
    if missing:
        return f"model shards of rank(s) {missing} of {world} missing"
    return None


def step_folders(ckpt_dir: Path) -> dict[int, Path]:
    """{N: CKPT/global_step_N} for every folder named like a step, complete or not."""
    return dict(sorted((int(m.group(1)), d) for d in Path(ckpt_dir).iterdir() if (m := STEP_RE.match(d.name))))


def read_tracker(ckpt_dir: Path) -> int | None | str:
    """The step the tracker names; None when there is no tracker; a string saying why when it
    cannot be read as verl reads it."""
    path = Path(ckpt_dir) / TRACKER
    if not path.exists():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeError) as e:
        return f"{path} unreadable ({e})"
    try:
        return int(text.strip())
    except ValueError:
        return f"{path} holds {text[:20]!r}, not a step number"


def saved_steps(ckpt_dir: Path, warn: Callable[[str], None] | None = print) -> dict[int, Path]:
    """{N: CKPT/global_step_N/actor} for every complete step that the tracker covers (N at most the
    step it names, when it names one); ``warn`` names every other step folder and why."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint folder {ckpt_dir} does not exist")
    tracked = read_tracker(ckpt_dir)
    steps = {}
    for n, d in step_folders(ckpt_dir).items():
        why = step_problem(d / "actor")
        if why is None and isinstance(tracked, int) and n > tracked:
            why = f"newer than the step {TRACKER} names ({tracked}): verl never finished saving it"
        if why is None:
            steps[n] = d / "actor"
        elif warn is not None:
            warn(f"[ckpt] {d} left out: {why}")
    return steps


def repair_tracker(ckpt_dir: Path, log: Callable[[str], None] = print) -> int | None:
    """Make the tracker name the newest complete step when it is empty, unreadable, or names a
    step that is not complete (a crash while verl saved); returns the step it names (None: no
    tracker and nothing to resume, left as it is)."""
    ckpt_dir = Path(ckpt_dir)
    tracked = read_tracker(ckpt_dir) if ckpt_dir.is_dir() else None
    if tracked is None:
        return None
    folders = step_folders(ckpt_dir)
    if isinstance(tracked, int) and tracked in folders and step_problem(folders[tracked] / "actor") is None:
        return tracked
    complete = [n for n, d in folders.items() if step_problem(d / "actor") is None
                and not (isinstance(tracked, int) and n > tracked)]
    why = tracked if isinstance(tracked, str) else f"{TRACKER} names step {tracked}, which is not complete"
    if not complete:
        (ckpt_dir / TRACKER).unlink()
        log(f"[ckpt] {why}; no complete step to resume from: tracker removed, training starts afresh")
        return None
    atomic_write_text(ckpt_dir / TRACKER, str(complete[-1]))
    log(f"[ckpt] {why}; repaired: it names global_step_{complete[-1]}, the newest complete step, "
        "and training resumes from there")
    return complete[-1]
