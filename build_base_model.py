#!/usr/bin/env python
"""Embedded preset, stage -1: pretrain the tiny CosyVoice2-format base model.

Trains a small Qwen2LM on (text, simulated speech codes) pairs from the corpus,
with deliberate label noise so that held-out error starts well above zero, and
writes OUT/llm.pt + OUT/CosyVoice-BlankEN/ like the released CosyVoice2 model.
Deterministic from --seed (whatever the thread count); cached (a second run with the same
inputs skips). Off a terminal it prints a progress line (step, loss, elapsed, ETA) at
least every 30 s; on a terminal a progress bar.
"""

import argparse
import dataclasses
import sys

from ttsrl.embedded.pretrain import PretrainConfig, build_base_model


def main(argv=None) -> int:
    d = PretrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="training JSONL with a 'text' field")
    p.add_argument("--out", required=True, help="output folder (llm.pt + CosyVoice-BlankEN/)")
    p.add_argument("--heldout", help="held-out JSONL: report the base model's CER on it (greedy and sampled)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (default %(default)s)")
    p.add_argument("--tone-noise", type=float, default=d.tone_noise,
                   help="share of training syllables given a wrong tone (default %(default)s)")
    p.add_argument("--initial-noise", type=float, default=d.initial_noise)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads (default 0: the cores free at the start, from the load average);"
                        " it sets the speed only (1 and 2 threads build the same weights)")
    a = p.parse_args(argv)
    if a.threads < 0:
        p.error(f"--threads must be >= 0 (0: the cores free now), got {a.threads}")
    cfg = dataclasses.replace(d, steps=a.steps, tone_noise=a.tone_noise, initial_noise=a.initial_noise, seed=a.seed,
                              threads=a.threads)
    try:
        build_base_model(a.corpus, a.out, cfg, heldout=a.heldout)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
