"""Saved and merged training steps, and the choice of the step to export.

Layout (stage 2 and 3): ``CKPT_DIR/global_step_N/actor`` (FSDP shards) and
``MERGED_DIR/step_N/`` (HF checkpoint). Step 0 is the converted start model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_STEP_RE = re.compile(r"^step_(\d+)$")


def merged_steps(merged_dir: str | Path) -> dict[int, Path]:
    """step -> folder for every complete merged step (stage 3 writes its marker last)."""
    from .merge import is_merged

    d = Path(merged_dir)
    out = {}
    if d.is_dir():
        for p in d.iterdir():
            m = _STEP_RE.match(p.name)
            if m and is_merged(p):
                out[int(m.group(1))] = p
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
    steps = merged_steps(merged_dir)
    if step not in steps:
        raise ValueError(f"step {step} is not merged in {merged_dir} (have {sorted(steps) or 'none'})")
    return steps[step]
