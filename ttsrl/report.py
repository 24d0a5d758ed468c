"""Stage 4's files and report: per-pair results and summaries, the sweep table and plot.

    OUT/step_N/<test_set>/results.jsonl   one row per utterance
    OUT/step_N/<test_set>/summary.json    micro-averaged CER, pinyin error, reward, ...
    OUT/report.md, OUT/summary.json (rows: step, model, test_set, cer, pinyin_error,
    reward, n, failures) and OUT/cer.png
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from .atomic import atomic_path, atomic_write_text

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
PLOT_FILE = "cer.png"


def pair_dir(out_dir: Path, step: int, test_set: str) -> Path:
    return out_dir / f"step_{step}" / test_set


def summarize(rows: Sequence[dict]) -> dict:
    """Micro-averaged rates (sum of errors / sum of reference lengths)."""
    ce, cn = sum(r["cer_errors"] for r in rows), sum(r["ref_len"] for r in rows)
    pe, pn = sum(r["pinyin_errors"] for r in rows), sum(r["pinyin_ref_len"] for r in rows)
    failed = [r["id"] for r in rows if r["failure"]]
    n = len(rows)
    return {"n": n, "failures": len(failed), "failed_ids": failed,
            "cer": ce / cn if cn else (0.0 if ce == 0 else 1.0), "cer_errors": ce, "cer_ref_len": cn,
            "pinyin_error": pe / pn if pn else (0.0 if pe == 0 else 1.0), "pinyin_errors": pe,
            "pinyin_ref_len": pn, "reward": sum(r["reward"] for r in rows) / n if n else 0.0,
            "mean_codes": sum(r["n_codes"] for r in rows) / n if n else 0.0,
            "stopped": sum(1 for r in rows if r["stopped"])}


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


SWEEP_KEYS = ("step", "model", "test_set", "cer", "pinyin_error", "reward", "n", "failures")


def write_sweep(out_dir: Path, models: dict[int, Path], names: Sequence[str]) -> list[dict]:
    """report.md, summary.json and cer.png from the per-model summaries on disk."""
    rows = []
    for step in sorted(models):
        for name in names:
            p = pair_dir(out_dir, step, name) / SUMMARY_FILE
            if p.is_file():
                s = json.loads(p.read_text())
                rows.append({**{k: s[k] for k in SWEEP_KEYS}, **sampling_of(s)})
    write_json(out_dir / SUMMARY_FILE, rows)
    atomic_write_text(out_dir / REPORT_FILE, "# CER sweep (stage 4)\n\n" + format_table(rows) + "\n")
    plot_cer(rows, out_dir / PLOT_FILE)
    return rows


def sampling_of(summary: dict) -> dict:
    """How a pair was decoded: sampling rule (or greedy) and min/max token-text ratios.
    Summaries written before the rule was recorded used the cosyvoice2-2024 rule."""
    st = summary.get("settings") or {}
    sp = st.get("sampling") or {}
    return {"rule": "greedy" if st.get("greedy") else sp.get("rule", "cosyvoice2-2024"),
            "min_ratio": sp.get("min_token_text_ratio"), "max_ratio": sp.get("max_token_text_ratio")}


def format_table(rows: Sequence[dict]) -> str:
    head = ("| step | test set | CER | pinyin error | mean reward | n | failures | sampling | min/max ratio |\n"
            "|---:|---|---:|---:|---:|---:|---:|---|---|")
    lines = [head]
    best = {}
    for r in rows:
        if r["test_set"] not in best or r["cer"] < best[r["test_set"]]:
            best[r["test_set"]] = r["cer"]
    for r in rows:
        label = "0 (start)" if r["step"] == 0 else str(r["step"])
        mark = " *" if len(rows) > 1 and math.isclose(r["cer"], best[r["test_set"]]) else ""
        lines.append(f"| {label} | {r['test_set']} | {100 * r['cer']:.2f}%{mark} | {100 * r['pinyin_error']:.2f}% "
                     f"| {r['reward']:.3f} | {r['n']} | {r['failures']} | {r.get('rule', '?')} "
                     f"| {r.get('min_ratio', '?')}/{r.get('max_ratio', '?')} |")
    return "\n".join(lines) + ("\n\n`*` lowest CER of its test set." if len(rows) > 1 else "")


def plot_cer(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["test_set"] for r in rows):
        pts = sorted((r["step"], 100 * r["cer"]) for r in rows if r["test_set"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("training step (0 = start model)")
    ax.set_ylabel("CER (%)")
    ax.set_title("held-out CER by step")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
