"""Stage 2's console: verl's full output to a log file, one compact line per step on screen;
and :class:`ProgressLines`, the periodic progress line of the other long loops off a terminal.

verl's ``console`` logger prints every metric of a step on one line
(``step:12 - actor/entropy:... - critic/score/mean:... - ...``, about 3 KB), and
Ray forwards every worker's output to the driver. ``run.sh`` pipes all of it
through this filter::

    python train_grpo.py ... 2>&1 | python -m ttsrl.console --log exp/logs/train_grpo.log

Every byte goes to ``--log`` (appended, so a resumed run keeps the killed run's
log). The terminal gets ``[train_grpo]`` lines (the exact verl command) and, per
step, one line: step/total, mean reward (``critic/score/mean``, the reward
function's score), the reward's terms when the step logs them (``cer``, ``sim``, ``length``
and the share of rollouts ``unfinished``; the shares of rollouts with ``no reward`` and of ``groups
dropped``, and of ``flat groups``, whose rollouts all scored the same and so teach nothing:
``reward/<key>/mean`` and ``reward/{no_reward,groups_dropped,groups_flat}/share``, which our verl plugin adds,
``ttsrl.verl_plugin.reward_metrics``; else ``gdpo/<key>/mean``, which verl logs for
``--algorithm gdpo``; ``sim`` only where it was measured), mean response length, step time, ETA,
and the validation reward at the steps that validate. SIGINT is ignored here so that after Ctrl-C
verl's shutdown output still reaches the log; the filter ends at end of input.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Optional

from ttsrl.cli import add_fields, given, option

STEP_RE = re.compile(r"^step:(\d+) - (.*)$")
TOTAL_RES = (re.compile(r"trainer\.total_training_steps=(\d+)"),
             re.compile(r"Training Progress:.*?\|\s*\d+/(\d+)\s*\["))  # verl's tqdm bar
PASS_PREFIXES = ("[train_grpo]",)  # train_grpo.py's own lines (the exact verl command)
REWARD_KEY = "critic/score/mean"
LENGTH_KEY = "response_length/mean"
STEP_TIME_KEY = "timing_s/step"
VAL_REWARD_RE = re.compile(r"^val-core/.*/reward/mean@\d+$")
TERM_KEYS = ("cer", "sim", "length")  # the reward's terms (ttsrl.reward.rewards), shown in this order
TERM_SOURCES = ("reward/{}/mean", "gdpo/{}/mean")  # ttsrl's plugin's metric, else verl's gdpo one
UNFINISHED_KEY = "reward/unfinished/mean"
# the step's rollouts without a reward and its groups verl cut short (ttsrl.verl_plugin.reward_metrics)
NO_REWARD_KEY = "reward/no_reward/share"
GROUPS_DROPPED_KEY = "reward/groups_dropped/share"
GROUPS_FLAT_KEY = "reward/groups_flat/share"  # groups of equal scores: no advantage, nothing learnt
SIM_MEASURED_KEY = "reward/sim_measured/mean"
_NP_RE = re.compile(r"^np\.\w+\((.*)\)$")  # np.float64(0.5) -> 0.5
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix on output forwarded from an actor: "(TaskRunnerV1 pid=42)", "(pid=7, ip=10.0.0.2)"
_RAY_PREFIX_RE = re.compile(r"^\((?:[\w.:-]+ )?pid=\d+(?:, ip=[\w.:]+)?\)\s?")


def strip_ray_prefix(line: str) -> str:
    """The line as its process printed it: without Ray's colours and ``(Actor pid=N)`` prefix.
    (verl's trainer runs in a Ray actor, so its metric lines reach the driver prefixed.)"""
    return _RAY_PREFIX_RE.sub("", _ANSI_RE.sub("", line))


def parse_metrics(line: str) -> Optional[tuple[int, dict[str, float]]]:
    """One line of verl's console logger -> (step, numeric metrics); None for other lines."""
    m = STEP_RE.match(strip_ray_prefix(line).strip())
    if not m:
        return None
    metrics: dict[str, float] = {}
    for item in m.group(2).split(" - "):
        key, _, value = item.partition(":")
        value = _NP_RE.sub(r"\1", value.strip())
        try:
            metrics[key.strip()] = float(value)
        except ValueError:
            continue
    return int(m.group(1)), metrics


def share(x: float) -> str:
    """A share as a percentage that never rounds a loss away: 0% only for none (0.4% stays 0.4%)."""
    if x == 0:
        return "0%"
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def duration(seconds: float) -> str:
    """A short human duration: 45s, 3m05s, 1h02m."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressLines:
    """Progress of a long loop as plain lines, for output that is not a terminal (a log file,
    a pipe), where a redrawn bar would be silent or garble the file: ``update`` after each
    step prints ``label: step N/TOTAL  loss 1.234  elapsed 1m05s  ETA 3m10s`` at the first
    step, then at most every ``every_s`` seconds, and at the last step. ``clock`` is
    injectable (tests drive it by hand)."""

    def __init__(self, total: int, label: str, every_s: float = 30.0, out: Optional[IO[str]] = None,
                 clock=time.monotonic) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self.out, self.clock = out, clock
        self.start = clock()
        self.last: Optional[float] = None

    def update(self, step: int, **values: float) -> Optional[str]:
        """``step`` steps are done; returns (and prints) the line when one is due."""
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s and step < self.total:
            return None
        self.last = now
        elapsed = now - self.start
        parts = [f"{self.label}: step {step:>{len(str(self.total))}}/{self.total}"]
        parts += [f"{k} {v:.3f}" for k, v in values.items()]
        parts.append(f"elapsed {duration(elapsed)}")
        if 0 < step < self.total:
            parts.append(f"ETA {duration(elapsed / step * (self.total - step))}")
        line = "  ".join(parts)
        print(line, file=self.out if self.out is not None else sys.stdout, flush=True)
        return line


class StepConsole:
    """Turns verl's output lines into the compact console lines (``feed`` one line at a time)."""

    def __init__(self, total_steps: Optional[int] = None, window: int = 10) -> None:
        self.total = total_steps
        self.step_times: deque[float] = deque(maxlen=window)
        self.rewards: list[tuple[int, float]] = []
        self.val_rewards: list[tuple[int, float]] = []

    def feed(self, line: str) -> Optional[str]:
        """Returns the console line for ``line``, or None when it only belongs in the log."""
        for pattern in TOTAL_RES:
            t = pattern.search(line)
            if t:
                self.total = int(t.group(1))
        if line.startswith(PASS_PREFIXES):
            return line
        parsed = parse_metrics(line)
        return self.format(*parsed) if parsed else None

    def format(self, step: int, metrics: dict[str, float]) -> str:
        total = f"/{self.total}" if self.total else ""
        width = len(str(self.total)) if self.total else 3
        parts = [f"step {step:>{width}}{total}"]
        if REWARD_KEY in metrics:
            self.rewards.append((step, metrics[REWARD_KEY]))
            parts.append(f"reward {metrics[REWARD_KEY]:.3f}")
        parts += self.terms(metrics)
        if LENGTH_KEY in metrics:
            parts.append(f"len {metrics[LENGTH_KEY]:5.1f}")
        val = [v for k, v in metrics.items() if VAL_REWARD_RE.match(k)]
        if val:
            self.val_rewards.append((step, sum(val) / len(val)))
            parts.append(f"val reward {self.val_rewards[-1][1]:.3f}")
        if STEP_TIME_KEY in metrics:
            self.step_times.append(metrics[STEP_TIME_KEY])
            parts.append(f"{metrics[STEP_TIME_KEY]:5.1f} s/step")
            if self.total and step < self.total:
                mean = sum(self.step_times) / len(self.step_times)
                parts.append(f"ETA {duration(mean * (self.total - step))}")
        if step == 0 or REWARD_KEY not in metrics and val:
            parts.append("(validation)")
        return "  ".join(parts)

    @staticmethod
    def terms(metrics: dict[str, float]) -> list[str]:
        """``cer 0.612  sim 0.284  length 0.973  unfinished 3%`` for the terms the step logged; SIM
        left out when no rollout of the step had it measured (its 0.0 would read as a value)."""
        out = []
        for key in TERM_KEYS:
            if key == "sim" and metrics.get(SIM_MEASURED_KEY, 1.0) == 0.0:
                continue
            value = next((metrics[s.format(key)] for s in TERM_SOURCES if s.format(key) in metrics), None)
            if value is not None:
                out.append(f"{key} {value:.3f}")
        if UNFINISHED_KEY in metrics:
            out.append(f"unfinished {100 * metrics[UNFINISHED_KEY]:.0f}%")
        if NO_REWARD_KEY in metrics:  # shown at 0% too: the line says the rewards were checked
            out.append(f"no reward {share(metrics[NO_REWARD_KEY])}")
        if GROUPS_DROPPED_KEY in metrics:
            out.append(f"groups dropped {share(metrics[GROUPS_DROPPED_KEY])}")
        if GROUPS_FLAT_KEY in metrics:
            out.append(f"flat groups {share(metrics[GROUPS_FLAT_KEY])}")
        return out

    def summary(self) -> Optional[str]:
        if not self.rewards:
            return None
        (s0, r0), (s1, r1) = self.rewards[0], self.rewards[-1]
        text = f"train reward {r0:.3f} (step {s0}) -> {r1:.3f} (step {s1})"
        if len(self.val_rewards) > 1:
            (v0s, v0), (v1s, v1) = self.val_rewards[0], self.val_rewards[-1]
            text += f"; val reward {v0:.3f} (step {v0s}) -> {v1:.3f} (step {v1s})"
        return text


RUN_MARKER = "stage 2 output follows"  # the line main() writes into the log at each run's start
_CAUSE_RE = re.compile(r"\[Errno \d+\]|No space left on device|Out of memory|(?:^|\s)(?:[\w.]+(?:Error|Exception)"
                       r"|Killed|Segmentation fault)\b:?")
_WARNING_RE = re.compile(r"warn", re.IGNORECASE)


def causes(lines: list[str], limit: int = 5) -> list[str]:
    """The lines of a failed run's output that say why (an OSError's errno, an exception's last
    line, an OOM kill), first seen first, each once, Ray's actor prefix dropped; warnings are not
    causes. On a full disk the tail of the log is pages of warnings and the cause is above them."""
    out: list[str] = []
    for raw in lines:
        line = strip_ray_prefix(_ANSI_RE.sub("", raw)).strip()
        if line and _CAUSE_RE.search(line) and not _WARNING_RE.search(line) and line not in out:
            out.append(line[:400])
            if len(out) == limit:
                break
    return out


def last_run(log_text: str) -> list[str]:
    """The lines of ``log_text`` after its last run marker (the whole text when it has none)."""
    at = log_text.rfind(RUN_MARKER)
    return (log_text[at:] if at >= 0 else log_text).splitlines()[1 if at >= 0 else 0:]


def run(stream: IO[bytes], log: IO[bytes], out: IO[str], total_steps: Optional[int] = None) -> StepConsole:
    console = StepConsole(total_steps)
    for raw in stream:
        log.write(raw)
        log.flush()
        # tqdm redraws with \r: each redraw is a line of its own here
        for piece in raw.decode("utf-8", errors="replace").replace("\r", "\n").splitlines():
            shown = console.feed(piece)
            if shown is not None:
                print(shown, file=out, flush=True)
    summary = console.summary()
    if summary:
        print(summary, file=out, flush=True)
    return console


@dataclass
class ConsoleArgs:
    """``python -m ttsrl.console``'s settings; each field is also its option."""
    log: Optional[str] = option(None, help="file that receives every line (appended); required unless --why")
    why: Optional[str] = option(None, metavar="LOG", help="print the lines of LOG's last run that say why it failed "
                                                          "(errno, exception, OOM), then exit (run.sh, when stage 2 "
                                                          "fails)")
    total_steps: Optional[int] = option(None, help="for the ETA; otherwise read from the verl command or verl's "
                                                   "progress bar")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, ConsoleArgs)
    args = ConsoleArgs(**given(p.parse_args(argv), ConsoleArgs))
    if args.why:
        found = causes(last_run(open(args.why, encoding="utf-8", errors="replace").read()))
        for line in found:
            print(f"  {line}")
        return
    if not args.log:
        p.error("--log is required (or --why LOG)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(args.log, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {RUN_MARKER}\n".encode())
        print(f"[console] one line per step here; verl's full metrics and worker logs: {args.log}", flush=True)
        run(sys.stdin.buffer, log, sys.stdout, args.total_steps)


if __name__ == "__main__":
    main()
