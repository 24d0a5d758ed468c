"""Saved and merged training steps, and the choice of the step to export.

Layout (stage 2 and 3): ``CKPT_DIR/global_step_N/actor`` (FSDP shards) and
``MERGED_DIR/step_N/`` (HF checkpoint). Step 0 is the converted start model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

_STEP_RE = re.compile(r"^step_(\d+)$")


def merged_steps(merged_dir: str | Path, warn: Callable[[str], None] | None = print) -> dict[int, Path]:
    """step -> folder for every complete, verified merged step (marker written last,
    every file of its recorded size and sha256). A ``step_N`` that fails the check is
    left out, and ``warn`` says which and why."""
    from .merge import check_merged

    d = Path(merged_dir)
    out = {}
    if d.is_dir():
        for p in sorted(d.iterdir()):
            m = _STEP_RE.match(p.name)
            if not (m and p.is_dir()):
                continue
            why = check_merged(p)
            if why is None:
                out[int(m.group(1))] = p
            elif warn is not None:
                warn(f"warning: {p} left out: not a complete, verified step ({why})")
    return dict(sorted(out.items()))


def best_step(summary_path: str | Path) -> int:
    """Step with the lowest CER (mean over test sets) in a stage-4 ``summary.json``;
    ties go to the earlier step."""
    rows = json.loads(Path(summary_path).read_text())
    by_step: dict[int, list[float]] = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), []).append(float(r["cer"]))
    if not by_step:
        raise ValueError(f"{summary_path}: no rows")
    return min(by_step, key=lambda s: (sum(by_step[s]) / len(by_step[s]), s))


def model_dir_for(step: int, start_model: str | Path, merged_dir: str | Path) -> Path:
    if step == 0:
        return Path(start_model)
    from .merge import check_merged

    path = Path(merged_dir) / f"step_{step}"
    why = check_merged(path) if path.is_dir() else "absent"
    if why is not None:
        have = sorted(int(m.group(1)) for p in Path(merged_dir).glob("step_*") if (m := _STEP_RE.match(p.name)))
        raise ValueError(f"step {step} in {merged_dir} is not a complete, verified step: {why} "
                         f"(step folders there: {have or 'none'})")
    return path
