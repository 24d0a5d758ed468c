"""GRPO variants compared at an equal wall-clock budget (``scripts/compare_algorithms.sh``).

The script leaves one folder per run, ``ALGORITHM-seedS/``, each with stage 2's log
(``logs/train_grpo.log``: verl's metric line per step, its ``timing_s/step`` and
``response_length/mean``) and stage 4's sweep (``eval/summary.json`` and per-utterance
results of every saved step, start model included). Here:

- the budget is training time: the sum of ``timing_s/step`` (rollout, reward, update and
  checkpoint saves; Ray's start-up is the same for every run and left out). An algorithm's
  cost is its seconds per step averaged over its seeds (one run's step times move by tens of
  percent with the rollout's batching; the spread between seeds is reported), and it gets the
  steps that cost fits into the budget. Default budget: the fastest algorithm's time for all
  its steps plus 10%, so algorithms of the same cost within timing noise count as equally fast;
- per run: the last saved step within its algorithm's steps ("at equal time"), the last saved
  step ("after all steps", every run trains as many), the step chosen on the dev set among all
  saved steps ("best", as stage 5 chooses), the test CER of each, the mean response length of
  its training rollouts within the budget. Checkpoints come every few steps, so an algorithm a
  little over the budget is judged a whole save interval earlier: read both columns, with the
  seconds per step;
- per algorithm: the seeds' figures side by side and their mean, and the difference to the
  reference algorithm at equal time by a paired bootstrap over test utterances (each
  utterance's rate averaged over the seeds, ``ttsrl.stats.UttTable``): the interval covers
  which utterances were drawn, not training seeds; the per-seed columns show that spread.

CER is the stage-4 headline (``cer_utt_mean``, Seed-TTS eval's per-utterance mean) under the
sweep's own sampling rule, which every run shares.

A run folder may also name the reward weighting it trained on, ``ALGORITHM+WEIGHTS-seedS``
(``grpo+glm_tts-seed1``: GRPO on CER + 0.1 SIM; ``grpo+0.2-seed1``: on CER + 0.2 SIM; ``REWARD_WEIGHTS``
takes both forms); such a variant is compared
like an algorithm. Where stage 4 measured speaker similarity (a backend with a speaker model, a
zero-shot test set), the table adds SIM (``sim_mean``) at equal time and after all steps, with its
paired difference to the reference over the test utterances (each utterance's SIM averaged over
the seeds) and its 95% interval.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ttsrl.atomic import atomic_write_text
from ttsrl.cli import add_fields, given, option
from ttsrl.console import GROUPS_FLAT_KEY, LENGTH_KEY, STEP_TIME_KEY, parse_metrics
from ttsrl.eval.report import RESULTS_FILE, SUMMARY_FILE, mean_present, pair_dir, read_jsonl, sim_by_utt
from ttsrl.reward.rewards import WEIGHTS
from ttsrl.stats import UttTable, paired, paired_mean
from ttsrl.train.steps import choose_step

# +WEIGHTS: a named weighting (glm_tts) or the SIM weight itself (0.2), as REWARD_WEIGHTS takes them
RUN_RE = re.compile(r"^(?P<variant>(?P<algorithm>[a-z][a-z0-9_]*)"
                    r"(?:\+(?:(?P<weights>[a-z][a-z0-9_]*)|(?P<sim_weight>\d+(?:\.\d+)?)))?)-seed(?P<seed>\d+)$")
HEADLINE = "cer_utt_mean"
TRAIN_LOG = Path("logs") / "train_grpo.log"
EVAL_DIR = Path("eval")


@dataclass
class Run:
    """One training run: its step times, rollout lengths and stage-4 rows. ``algorithm`` is the
    variant compared: the estimator, and ``+WEIGHTS`` where the run names its reward weighting."""

    algorithm: str
    seed: int
    path: Path
    step_s: dict[int, float] = field(default_factory=dict)
    length: dict[int, float] = field(default_factory=dict)
    flat: dict[int, float] = field(default_factory=dict)  # share of the step's groups with equal scores
    rows: list[dict] = field(default_factory=list)

    def elapsed(self, step: int) -> float:
        """Training seconds of steps 1..step."""
        return sum(t for s, t in self.step_s.items() if s <= step)

    @property
    def total_s(self) -> float:
        return self.elapsed(max(self.step_s, default=0))

    @property
    def s_per_step(self) -> float:
        return self.total_s / len(self.step_s)

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
        raise ValueError(f"{path}: a run folder is named ALGORITHM-seedS or ALGORITHM+WEIGHTS-seedS "
                         "(scripts/compare_algorithms.sh)")
    if m["weights"] is not None and m["weights"] not in WEIGHTS:
        raise ValueError(f"{path}: unknown reward weights {m['weights']!r} (one of {', '.join(WEIGHTS)}, "
                         "or a SIM weight: grpo+0.2)")
    run = Run(m["variant"], int(m["seed"]), path)
    log = path / TRAIN_LOG
    for line in log.read_text(errors="replace").splitlines():
        parsed = parse_metrics(line)
        if parsed and STEP_TIME_KEY in parsed[1]:
            step, metrics = parsed
            run.step_s[step] = metrics[STEP_TIME_KEY]
            if LENGTH_KEY in metrics:
                run.length[step] = metrics[LENGTH_KEY]
            if GROUPS_FLAT_KEY in metrics:
                run.flat[step] = metrics[GROUPS_FLAT_KEY]
    if not run.step_s:
        raise ValueError(f"{log}: no verl step line with {STEP_TIME_KEY} (did stage 2 train?)")
    summary = path / EVAL_DIR / SUMMARY_FILE
    if not summary.is_file():
        raise ValueError(f"{summary} not found: stage 4 has not scored this run")
    run.rows = json.loads(summary.read_text())
    return run


def read_runs(folder: Path, skipped: Optional[list[str]] = None) -> list[Run]:
    """Every scored run under ``folder``; one not scored yet (still training, or died) is left
    out and its reason appended to ``skipped`` (given) or raised (not given)."""
    runs = []
    for p in sorted(folder.iterdir()):
        if not (p.is_dir() and RUN_RE.match(p.name)):
            continue
        try:
            runs.append(read_run(p))
        except (OSError, ValueError) as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
    if not runs:
        raise ValueError(f"{folder}: no scored ALGORITHM-seedS run folders" +
                         "".join(f"\n  {why}" for why in skipped or []))
    return runs


def judge(run: Run, done: int) -> dict:
    """One run's figures after all its steps and after ``done`` steps (the budget's)."""
    final = max(run.scored_steps())
    at = max((s for s in run.scored_steps() if s <= done), default=0)
    at_row = run.test_row(at)
    chosen = choose_step(run.rows)["step"]
    return {
        "algorithm": run.algorithm, "seed": run.seed, "steps_done": done, "steps_run": max(run.step_s),
        "s_per_step": run.s_per_step, "total_s": run.total_s,
        "start_cer": run.test_row(0)[HEADLINE],
        "final_step": final, "final_s": run.elapsed(final), "cer_final": run.test_row(final)[HEADLINE],
        "step_at_budget": at, "cer_at_budget": at_row[HEADLINE], "ci_at_budget": at_row["ci"][HEADLINE],
        "best_step": chosen, "cer_best": run.test_row(chosen)[HEADLINE] if chosen is not None else None,
        "response_length": mean_present(v for s, v in run.length.items() if s <= done),
        "flat_groups": mean_present(v for s, v in run.flat.items() if s <= done),
        "flat_first": run.flat.get(min(run.flat, default=-1)),
        "flat_last": run.flat.get(max((s for s in run.flat if s <= done), default=-1)),
        "length_ratio_at_budget": at_row.get("length_ratio_mean"),
        "start_sim": run.test_row(0).get("sim_mean"), "sim_final": run.test_row(final).get("sim_mean"),
        "sim_at_budget": at_row.get("sim_mean"),
    }


MEANS = ("steps_done", "s_per_step", "final_s", "cer_final", "cer_at_budget", "cer_best", "response_length",
         "length_ratio_at_budget", "sim_final", "sim_at_budget", "flat_groups", "flat_first", "flat_last")


TOLERANCE = 0.10


def compare(runs: Sequence[Run], budget_s: Optional[float] = None, reference: str = "grpo",
            tolerance: float = TOLERANCE) -> dict:
    """Per-run and per-algorithm figures at ``budget_s`` and after every run's last scored step,
    each with its paired difference to ``reference``.

    An algorithm's cost is its seconds per step averaged over its runs (one run's step times
    move by tens of percent with the machine and the rollout's batching, which the seeds show:
    ``timing_spread``), so both seeds of an algorithm are judged after the same number of steps:
    as many as its mean step time fits into the budget. Default budget: the fastest algorithm's
    mean time for all its steps plus ``tolerance`` of it, so that algorithms of equal cost
    within timing noise count as equally fast."""
    algorithms = list(dict.fromkeys(r.algorithm for r in runs))
    per_step = {a: mean_present(r.s_per_step for r in runs if r.algorithm == a) for a in algorithms}
    steps = {a: max(max(r.step_s) for r in runs if r.algorithm == a) for a in per_step}
    fastest = min(per_step, key=lambda a: per_step[a] * steps[a])
    budget = budget_s if budget_s is not None else per_step[fastest] * steps[fastest] * (1 + tolerance)
    per_run = [judge(r, min(max(r.step_s), int(budget / per_step[r.algorithm] + 1e-9))) for r in runs]

    def pooled(step_key: str) -> dict[str, UttTable]:
        return {a: UttTable.from_rows([u for r, j in zip(runs, per_run) if r.algorithm == a
                                       for u in r.utterances(j[step_key])]) for a in algorithms}

    def sims(step_key: str) -> dict[str, dict[str, float]]:
        """Per variant: utterance id -> its SIM averaged over the seeds (the utterances with one)."""
        out = {}
        for a in algorithms:
            per: dict[str, list[float]] = {}
            for r, j in zip(runs, per_run):
                if r.algorithm == a:
                    for u, v in sim_by_utt(r.utterances(j[step_key])).items():
                        per.setdefault(u, []).append(v)
            out[a] = {u: sum(v) / len(v) for u, v in per.items()}
        return out

    at_budget, at_final = pooled("step_at_budget"), pooled("final_step")
    with_sim = any(j["sim_final"] is not None for j in per_run)
    sim_budget, sim_final = (sims("step_at_budget"), sims("final_step")) if with_sim else ({}, {})
    table = []
    for a in algorithms:
        mine = [j for j in per_run if j["algorithm"] == a]
        entry = {"algorithm": a, "seeds": [j["seed"] for j in mine], "runs": mine,
                 **{k: mean_present([j[k] for j in mine]) for k in MEANS}}
        if reference in at_budget and a != reference:
            entry["vs_reference"] = paired(at_budget[a], at_budget[reference], HEADLINE)
            entry["vs_reference_final"] = paired(at_final[a], at_final[reference], HEADLINE)
            if with_sim:
                entry["sim_vs_reference"] = paired_mean(sim_budget[a], sim_budget[reference])
                entry["sim_vs_reference_final"] = paired_mean(sim_final[a], sim_final[reference])
        table.append(entry)
    table.sort(key=lambda e: e["cer_at_budget"])
    rule = ("given" if budget_s is not None else
            f"{fastest}'s {per_step[fastest] * steps[fastest]:.0f} s + {100 * tolerance:.0f}%")
    spread = max((max(t) / min(t) - 1 for a in per_step
                  if len(t := [r.total_s for r in runs if r.algorithm == a]) > 1), default=None)
    return {"budget_s": budget, "budget_rule": rule, "timing_spread": spread, "reference": reference,
            "metric": HEADLINE, "algorithms": table, "start_cer": mean_present([j["start_cer"] for j in per_run]),
            "start_sim": mean_present([j["start_sim"] for j in per_run]), "with_sim": with_sim}


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.2f}"


def _sim(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.3f}"


def _sim_delta(entry: dict, key: str, ref: str) -> str:
    v = entry.get(key)
    if v:
        return f"{v['diff']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]"
    return "(reference)" if entry["algorithm"] == ref else ""


def _flat(entry: dict) -> str:
    """The share of groups whose rollouts all scored the same (they teach nothing), over the steps in budget."""
    if entry.get("flat_groups") is None:
        return "n/a"
    return f"{100 * entry['flat_groups']:.0f} ({100 * entry['flat_first']:.0f} -> {100 * entry['flat_last']:.0f})"


def _seeds(entry: dict, key: str, fmt) -> str:
    return " / ".join(fmt(j[key]) for j in entry["runs"])


def _delta(entry: dict, key: str, ref: str) -> str:
    v = entry.get(key)
    if v:
        return f"{100 * v['diff']:+.2f} [{100 * v['lo']:+.2f}, {100 * v['hi']:+.2f}], {v['p_better']:.2f}"
    return "(reference)" if entry["algorithm"] == ref else ""


def format_table(result: dict) -> str:
    ref = result["reference"]
    spread = result.get("timing_spread")
    noise = f" (one algorithm's runs differ by up to {100 * spread:.0f}% in training time here)" if spread else ""
    with_sim = result.get("with_sim")
    start_sim = f", SIM {_sim(result.get('start_sim'))}" if with_sim else ""
    sim_note = (" SIM: stage 4's sim_mean (the backend's speaker model against each utterance's prompt; higher is "
                "better), Δ SIM paired over test utterances (SIM averaged over seeds), 95% interval." if with_sim else "")
    lines = [f"Start model: test CER {_pct(result['start_cer'])}%{start_sim}. Equal time: {result['budget_s']:.0f} s of "
             f"training ({result['budget_rule']}); an algorithm's cost is its mean s/step over its seeds{noise}, "
             f"and each run is judged at its last saved step within the steps that cost fits. Mean over seeds, "
             f"then each seed's value (seeds {', '.join(str(s) for s in result['algorithms'][0]['seeds'])}). "
             f"Δ: vs {ref}, paired bootstrap over test utterances (rates averaged over seeds), 95% interval, "
             f"P(better). Flat groups: the share of a step's groups of n rollouts that all got the same reward "
             f"(zero variance, zero advantage: they teach nothing), from stage 2's reward/groups_flat/share.{sim_note}",
             "",
             f"| algorithm | test CER at equal time (%) (step) | Δ vs {ref} at equal time | test CER after all steps "
             f"(%) | Δ vs {ref} after all steps | training time (s) | best test CER (%) (dev-chosen step) | "
             "steps in budget | s/step | mean response length (codes) | flat groups (%): mean (first step -> last) |"
             + (f" SIM at equal time | Δ SIM vs {ref} at equal time | SIM after all steps | Δ SIM vs {ref} after all "
                "steps |" if with_sim else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if with_sim else "")]
    for e in result["algorithms"]:
        lines.append(
            f"| {e['algorithm']} | {_pct(e['cer_at_budget'])} ({_seeds(e, 'cer_at_budget', _pct)}) "
            f"(step {_seeds(e, 'step_at_budget', str)}) | {_delta(e, 'vs_reference', ref)} | "
            f"{_pct(e['cer_final'])} ({_seeds(e, 'cer_final', _pct)}) | {_delta(e, 'vs_reference_final', ref)} | "
            f"{_seeds(e, 'final_s', lambda x: f'{x:.0f}')} | "
            f"{_pct(e['cer_best'])} ({_seeds(e, 'cer_best', _pct)}; step {_seeds(e, 'best_step', str)}) | "
            f"{_seeds(e, 'steps_done', str)} | {e['s_per_step']:.1f} | {e['response_length']:.1f} | {_flat(e)} |"
            + (f" {_sim(e['sim_at_budget'])} ({_seeds(e, 'sim_at_budget', _sim)}) | "
               f"{_sim_delta(e, 'sim_vs_reference', ref)} | {_sim(e['sim_final'])} ({_seeds(e, 'sim_final', _sim)}) | "
               f"{_sim_delta(e, 'sim_vs_reference_final', ref)} |" if with_sim else ""))
    return "\n".join(lines) + "\n"


@dataclass
class CompareRuns:
    """``python -m ttsrl.eval.compare``'s settings; each field is also its argument."""
    folder: Path = option(positional=True, parse=Path, metavar="folder",
                          help="COMPARE_DIR of scripts/compare_algorithms.sh")
    budget_s: Optional[float] = option(None, help="training seconds each algorithm is judged at, its steps costing "
                                                  "its mean s/step (none: the fastest algorithm's time for all its "
                                                  "steps + --tolerance)")
    tolerance: float = option(TOLERANCE, help="share of the fastest algorithm's time added to the default budget, "
                                              "so that algorithms as fast within timing noise count as equally fast")
    reference: str = option("grpo", help="the variant the others are compared with: an algorithm, or "
                                         "ALGORITHM+WEIGHTS as its run folders are named")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m ttsrl.eval.compare",
        description="Compare GRPO variants at an equal training-time budget from the run folders "
                    "scripts/compare_algorithms.sh leaves (ALGORITHM-seedS/, ALGORITHM+WEIGHTS-seedS/); writes "
                    "compare.md and "
                    "compare.json into the folder and prints the table.")
    add_fields(ap, CompareRuns)
    args = CompareRuns(**given(ap.parse_args(argv), CompareRuns))
    skipped: list[str] = []
    try:
        result = compare(read_runs(args.folder, skipped), args.budget_s, args.reference, args.tolerance)
    except (OSError, ValueError) as exc:
        ap.exit(2, f"compare: {exc}\n")
    for why in skipped:
        print(f"compare: left out: {why}", file=sys.stderr)
    result["left_out"] = skipped
    table = format_table(result)
    atomic_write_text(args.folder / "compare.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(args.folder / "compare.md", "# GRPO variants at equal time\n\n" + table)
    print(table, end="")


if __name__ == "__main__":
    main()
