"""GRPO variants compared at an equal wall-clock budget (``scripts/compare_algorithms.sh``).

The script leaves one folder per run, ``ALGORITHM-seedS/``, each with stage 2's log
(``logs/train_grpo.log``: verl's metric line per step, its ``timing_s/step`` and
``response_length/mean``) and stage 4's sweep (``eval/summary.json`` and per-utterance
results of every saved step, start model included). Here:

- the budget is training time: the sum of ``timing_s/step`` (rollout, reward, update and
  checkpoint saves; Ray's start-up is the same for every run and left out). Default: the
  time the fastest run took for all its steps, so every run is judged at a time all reached;
- per run: steps done within the budget, the last saved step within it ("at equal time"),
  the step chosen on the dev set among all saved steps ("best", as stage 5 chooses), the test
  CER of both, the mean response length of its training rollouts up to the budget;
- per algorithm: the seeds' figures side by side and their mean, and the difference to the
  reference algorithm at equal time by a paired bootstrap over test utterances (each
  utterance's rate averaged over the seeds, ``ttsrl.stats.UttTable``): the interval covers
  which utterances were drawn, not training seeds; the per-seed columns show that spread.

CER is the stage-4 headline (``cer_utt_mean``, Seed-TTS eval's per-utterance mean) under the
sweep's own sampling rule, which every run shares.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ttsrl.atomic import atomic_write_text
from ttsrl.console import LENGTH_KEY, STEP_TIME_KEY, parse_metrics
from ttsrl.eval.report import RESULTS_FILE, SUMMARY_FILE, pair_dir, read_jsonl
from ttsrl.stats import UttTable, paired
from ttsrl.train.steps import choose_step

RUN_RE = re.compile(r"^(?P<algorithm>[a-z][a-z0-9_]*)-seed(?P<seed>\d+)$")
HEADLINE = "cer_utt_mean"
TRAIN_LOG = Path("logs") / "train_grpo.log"
EVAL_DIR = Path("eval")


@dataclass
class Run:
    """One training run: its step times, rollout lengths and stage-4 rows."""

    algorithm: str
    seed: int
    path: Path
    step_s: dict[int, float] = field(default_factory=dict)
    length: dict[int, float] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)

    def elapsed(self, step: int) -> float:
        """Training seconds of steps 1..step."""
        return sum(t for s, t in self.step_s.items() if s <= step)

    def steps_within(self, budget_s: float) -> int:
        return max((s for s in self.step_s if self.elapsed(s) <= budget_s), default=0)

    @property
    def total_s(self) -> float:
        return self.elapsed(max(self.step_s, default=0))

    def scored_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.rows})

    def test_row(self, step: int) -> dict:
        rows = [r for r in self.rows if int(r["step"]) == step and r.get("role") == "test"]
        if not rows:
            raise ValueError(f"{self.path / EVAL_DIR / SUMMARY_FILE}: no test-set row for step {step}")
        return rows[0]

    def utterances(self, step: int) -> list[dict]:
        row = self.test_row(step)
        return read_jsonl(pair_dir(self.path / EVAL_DIR, step, row["test_set"]) / RESULTS_FILE)


def read_run(path: Path) -> Run:
    m = RUN_RE.match(path.name)
    if not m:
        raise ValueError(f"{path}: a run folder is named ALGORITHM-seedS (scripts/compare_algorithms.sh)")
    run = Run(m["algorithm"], int(m["seed"]), path)
    log = path / TRAIN_LOG
    for line in log.read_text(errors="replace").splitlines():
        parsed = parse_metrics(line)
        if parsed and STEP_TIME_KEY in parsed[1]:
            step, metrics = parsed
            run.step_s[step] = metrics[STEP_TIME_KEY]
            if LENGTH_KEY in metrics:
                run.length[step] = metrics[LENGTH_KEY]
    if not run.step_s:
        raise ValueError(f"{log}: no verl step line with {STEP_TIME_KEY} (did stage 2 train?)")
    summary = path / EVAL_DIR / SUMMARY_FILE
    if not summary.is_file():
        raise ValueError(f"{summary} not found: stage 4 has not scored this run")
    run.rows = json.loads(summary.read_text())
    return run


def read_runs(folder: Path) -> list[Run]:
    runs = [read_run(p) for p in sorted(folder.iterdir()) if p.is_dir() and RUN_RE.match(p.name)]
    if not runs:
        raise ValueError(f"{folder}: no ALGORITHM-seedS run folders")
    return runs


def judge(run: Run, budget_s: float) -> dict:
    """One run's figures at the budget."""
    done = run.steps_within(budget_s)
    at = max((s for s in run.scored_steps() if s <= done), default=0)
    chosen = choose_step(run.rows)["step"]
    lengths = [v for s, v in run.length.items() if s <= done]
    return {
        "algorithm": run.algorithm, "seed": run.seed, "steps_done": done, "steps_run": max(run.step_s),
        "s_per_step": run.total_s / len(run.step_s), "total_s": run.total_s,
        "start_cer": run.test_row(0)[HEADLINE],
        "step_at_budget": at, "cer_at_budget": run.test_row(at)[HEADLINE],
        "ci_at_budget": run.test_row(at)["ci"][HEADLINE],
        "best_step": chosen, "cer_best": run.test_row(chosen)[HEADLINE] if chosen is not None else None,
        "response_length": sum(lengths) / len(lengths) if lengths else None,
        "length_ratio_at_budget": run.test_row(at).get("length_ratio_mean"),
    }


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def compare(runs: Sequence[Run], budget_s: Optional[float] = None, reference: str = "grpo") -> dict:
    """Per-run and per-algorithm figures at ``budget_s`` (default: the fastest run's total time)."""
    budget = budget_s if budget_s is not None else min(r.total_s for r in runs)
    per_run = [judge(r, budget) for r in runs]
    algorithms = list(dict.fromkeys(r.algorithm for r in runs))
    table = []
    pooled = {a: UttTable.from_rows([u for r, j in zip(runs, per_run) if r.algorithm == a
                                     for u in r.utterances(j["step_at_budget"])]) for a in algorithms}
    for a in algorithms:
        mine = [j for j in per_run if j["algorithm"] == a]
        entry = {"algorithm": a, "seeds": [j["seed"] for j in mine], "runs": mine,
                 **{k: _mean([j[k] for j in mine]) for k in ("steps_done", "s_per_step", "cer_at_budget",
                                                              "cer_best", "response_length",
                                                              "length_ratio_at_budget")}}
        if reference in pooled and a != reference:
            entry["vs_reference"] = paired(pooled[a], pooled[reference], HEADLINE)
        table.append(entry)
    table.sort(key=lambda e: e["cer_at_budget"])
    return {"budget_s": budget, "reference": reference, "metric": HEADLINE, "algorithms": table,
            "start_cer": _mean([j["start_cer"] for j in per_run])}


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.2f}"


def _seeds(entry: dict, key: str, fmt) -> str:
    return " / ".join(fmt(j[key]) for j in entry["runs"])


def format_table(result: dict) -> str:
    ref = result["reference"]
    lines = [f"Budget: {result['budget_s']:.0f} s of training per run; start model test CER "
             f"{_pct(result['start_cer'])}%. Per-seed values after the mean (seed order "
             f"{', '.join(str(s) for s in result['algorithms'][0]['seeds'])}); Δ: paired bootstrap over test "
             f"utterances vs {ref} at equal time, 95% interval, P(better).", "",
             "| algorithm | test CER at equal time (%) | Δ vs " + ref + " [95% CI], P(better) | best test CER (%) "
             "(dev-chosen step) | steps in budget | s/step | mean response length (codes) |",
             "|---|---|---|---|---|---|---|"]
    for e in result["algorithms"]:
        v = e.get("vs_reference")
        delta = (f"{100 * v['diff']:+.2f} [{100 * v['lo']:+.2f}, {100 * v['hi']:+.2f}], {v['p_better']:.2f}"
                 if v else "(reference)" if e["algorithm"] == ref else "")
        lines.append(
            f"| {e['algorithm']} | {_pct(e['cer_at_budget'])} ({_seeds(e, 'cer_at_budget', _pct)}) | {delta} | "
            f"{_pct(e['cer_best'])} ({_seeds(e, 'cer_best', _pct)}; steps {_seeds(e, 'best_step', str)}) | "
            f"{_seeds(e, 'steps_done', str)} | {e['s_per_step']:.1f} | {e['response_length']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m ttsrl.eval.compare",
        description="Compare GRPO variants at an equal training-time budget from the run folders "
                    "scripts/compare_algorithms.sh leaves (ALGORITHM-seedS/); writes compare.md and "
                    "compare.json into the folder and prints the table.")
    ap.add_argument("folder", type=Path, help="COMPARE_DIR of scripts/compare_algorithms.sh")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="training seconds each run is judged at (default: the fastest run's total time)")
    ap.add_argument("--reference", default="grpo", help="the algorithm the others are compared with (grpo)")
    args = ap.parse_args(argv)
    try:
        result = compare(read_runs(args.folder), args.budget_s, args.reference)
    except (OSError, ValueError) as exc:
        ap.exit(2, f"compare: {exc}\n")
    table = format_table(result)
    atomic_write_text(args.folder / "compare.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(args.folder / "compare.md", "# GRPO variants at equal time\n\n" + table)
    print(table, end="")


if __name__ == "__main__":
    main()
