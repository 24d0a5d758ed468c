#!/usr/bin/env python
"""Embedded and speech presets, stage -1: pretrain the tiny base model.

Trains a small Qwen2LM on (text, speech codes) pairs from the corpus, the codes those of
the simulated codec (--family cosyvoice2/cosyvoice3) or Kokoro's phonemes from misaki's
Mandarin G2P (--family kokoro), with deliberate label noise so that held-out error starts
well above zero, and
writes OUT/llm.pt + OUT/CosyVoice-BlankEN/ like the released CosyVoice2 model.
Deterministic from --seed (whatever the thread count); cached (a second run with the same
inputs skips). Off a terminal it prints a progress line (step, loss, elapsed, ETA) at
least every 30 s; on a terminal a progress bar.
"""

import argparse
import sys
from dataclasses import dataclass

from ttsrl.cli import add_fields, given, option, parse_into
from ttsrl.embedded.pretrain import PretrainConfig, build_base_model


@dataclass
class BuildPaths:
    """What to build from and where; the training settings are PretrainConfig's."""
    corpus: str = option(help="training JSONL with a 'text' field")
    out: str = option(help="output folder (llm.pt + CosyVoice-BlankEN/)")
    heldout: str | None = option(None, help="held-out JSONL: report the base model's CER on it (greedy and sampled)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, BuildPaths)
    add_fields(p, PretrainConfig)
    args = p.parse_args(argv)
    a = BuildPaths(**given(args, BuildPaths))
    cfg = parse_into(p, PretrainConfig, args)
    try:
        if cfg.family == "kokoro":  # real phonemes (misaki's G2P as teacher), not the simulated codec
            from ttsrl.embedded.phoneme_lm import build_phoneme_lm
            build_phoneme_lm(a.corpus, a.out, cfg, heldout=a.heldout)
        else:
            build_base_model(a.corpus, a.out, cfg, heldout=a.heldout)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
