"""The choice of the step to export (stage 5) and the model folder of a step.

Step 0 is the converted start model; step N is ``MERGED_DIR/step_N`` as stage 3 or
DPO/KTO leave it (the layout and its check: ``ttsrl.model.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

from ttsrl.model.checkpoint import check_merged, step_folders, step_path


def choose_step(rows: list[dict], metric: str | None = None) -> dict:
    """The step stage 5 exports, chosen on the DEV sets of a stage-4 sweep only.

    Rows (``summary.json``) carry ``role`` ("dev" or "test") and ``headline`` (the metric
    the report leads with, default ``cer_utt_mean``). The chosen step has the lowest
    metric, averaged over the dev sets, among steps scored on every dev set; ties go to
    the earlier step. Test sets are never looked at. Without a dev set ``step`` is None
    and ``reason`` says what to do."""
    dev = [r for r in rows if r.get("role") == "dev"]
    if not dev:
        return {"step": None, "chosen_on": [], "metric": metric,
                "reason": "No dev set was scored, so no step is chosen: a test set is never used to choose. "
                          "Score a dev set (infer_dataset.py --dev-set NAME=PATH) or export a step by "
                          "number (EXPORT_STEP=N, --step N)."}
    metric = metric or dev[0].get("headline") or "cer_utt_mean"
    names = sorted({r["test_set"] for r in dev})
    by_step: dict[int, dict[str, float]] = {}
    for r in dev:
        if r.get(metric) is None:
            raise ValueError(f"dev row step {r['step']} / {r['test_set']} has no {metric} (re-run stage 4)")
        by_step.setdefault(int(r["step"]), {})[r["test_set"]] = float(r[metric])
    mean = {s: sum(v.values()) / len(v) for s, v in by_step.items() if len(v) == len(names)}
    best = min(mean, key=lambda s: (mean[s], s))
    return {"step": best, "chosen_on": names, "metric": metric, "value": mean[best],
            "by_step": {str(s): v for s, v in sorted(mean.items())},
            "reason": f"Stage 5 exports step {best}: the lowest {metric} on the dev set(s) {', '.join(names)} "
                      f"({100 * mean[best]:.2f}%; ties go to the earlier step). Test sets are reported for "
                      "every step and never used to choose."}


def model_dir_for(step: int, start_model: str | Path, merged_dir: str | Path) -> Path:
    if step == 0:
        return Path(start_model)
    path = step_path(merged_dir, step)
    why = check_merged(path) if path.is_dir() else "absent"
    if why is not None:
        raise ValueError(f"step {step} in {merged_dir} is not a complete, verified step: {why} "
                         f"(step folders there: {list(step_folders(merged_dir)) or 'none'})")
    return path
