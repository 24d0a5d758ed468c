"""DPO/KTO's console: one line per logging step on screen, TRL's full record in a log file.

transformers' ``Trainer`` prints the whole metrics dict of every logging step (through
``PrinterCallback`` without a progress bar, ``ProgressCallback.on_log`` with one), about
1 KB a step for TRL's DPO. :func:`install_console` swaps both for :class:`StepLines`,
which prints, like stage 2's console (``ttsrl.console``)::

    [dpo] step  3/40  loss 0.6812  margin 0.0213  acc 0.750  lr 1.00e-05  elapsed 12s  ETA 2m28s

and appends every record, as TRL logged it, to a JSON Lines file. The run's closing
record (``train_runtime``, mean ``train_loss``) becomes one closing line. On a terminal
the progress bar stays (its dict printing removed); off a terminal
:func:`bars_off_a_terminal` switches every bar off, so no redraws go to the log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Optional

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from ttsrl.console import duration

# (record key, label, format): shown in this order when the record has the key
COLUMNS = (("loss", "loss", ".4f"), ("rewards/margins", "margin", ".4f"), ("rewards/accuracies", "acc", ".3f"),
           ("kl", "kl", ".4f"), ("learning_rate", "lr", ".2e"))


class _QuietProgress(ProgressCallback):
    """The progress bar without its dict-per-step printing (the step lines replace it)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class StepLines(TrainerCallback):
    """Prints one line per logging step and appends each record to ``log_path``."""

    def __init__(self, log_path: str | Path, tag: str, out: Optional[IO[str]] = None, clock=time.monotonic) -> None:
        self.log_path, self.tag, self.out, self.clock = Path(log_path), tag, out, clock
        self.start: Optional[float] = None

    def _print(self, line: str) -> None:
        print(f"[{self.tag}] {line}", file=self.out if self.out is not None else sys.stdout, flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()
        if state.is_world_process_zero:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": "train_begin", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "max_steps": state.max_steps}) + "\n")
            self._print(f"one line per logging step here; every metric: {self.log_path}")

    def format(self, step: int, total: int, logs: dict) -> str:
        elapsed = self.clock() - (self.start if self.start is not None else self.clock())
        if "train_runtime" in logs:  # the closing record
            loss = f", mean loss {logs['train_loss']:.4f}" if "train_loss" in logs else ""
            return f"done: {step} steps in {duration(logs['train_runtime'])}{loss}"
        parts = [f"step {step:>{len(str(total))}}/{total}"]
        parts += [f"{label} {logs[key]:{fmt}}" for key, label, fmt in COLUMNS
                  if isinstance(logs.get(key), (int, float))]
        parts.append(f"elapsed {duration(elapsed)}")
        if 0 < step < total:
            parts.append(f"ETA {duration(elapsed / step * (total - step))}")
        return "  ".join(parts)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, **logs}, default=str) + "\n")
        self._print(self.format(state.global_step, state.max_steps, logs))


def bars_off_a_terminal() -> bool:
    """True when stderr is not a terminal; then every tqdm bar of the run is switched off
    (``TQDM_DISABLE``, which tqdm and TRL's reference log-prob precompute read). Pass the
    result as the trainer config's ``disable_tqdm``."""
    if sys.stderr.isatty():
        return False
    os.environ.setdefault("TQDM_DISABLE", "1")
    return True


def install_console(trainer, log_path: str | Path, tag: str) -> StepLines:
    """Replace ``trainer``'s dict printing with :class:`StepLines` (the bar, if any, stays)."""
    had_bar = any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if had_bar:
        trainer.add_callback(_QuietProgress())
    lines = StepLines(log_path, tag)
    trainer.add_callback(lines)
    return lines
