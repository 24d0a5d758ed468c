#!/usr/bin/env python
"""verl's custom reward function for TTS GRPO, and a by-hand checker.

In verl 0.9.1:
    reward.custom_reward_function.path=reward_tts.py
    reward.custom_reward_function.name=compute_score
Environment: TTSRL_REWARD_URL (default http://127.0.0.1:8000; a comma-separated list
spreads the requests over several servers and fails over), TTSRL_REWARD_MODEL
(default token2wav_asr), TTSRL_REWARD_MAX_FAIL_FRACTION (default 0.1: when more than
this share of the last TTSRL_REWARD_FAIL_WINDOW (64) rewards cannot be computed, the
call fails loudly), TTSRL_REWARD_RETRIES, TTSRL_REWARD_BACKOFF_S, TTSRL_REWARD_TIMEOUT_S.
The logic lives in ttsrl/reward/client.py and ttsrl/reward/pool.py.

By hand: python reward_tts.py --input rows.jsonl   (rows with "text" and "code"
[list of speech codes]) prints one reward per line, scored concurrently.
"""

from __future__ import annotations

import os
import sys

try:
    import ttsrl  # noqa: F401
except ImportError:  # verl loads this file by path; make the package next to it importable
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ttsrl.reward.client import compute_score  # noqa: E402  (verl looks this name up)

__all__ = ["compute_score"]


def main(argv=None) -> int:
    import argparse
    import asyncio
    import time
    from dataclasses import dataclass

    from ttsrl.cli import add_fields, option, parse_into
    from ttsrl.jsonl import iter_objects
    from ttsrl.reward.client import RewardClientConfig, score_all
    from ttsrl.reward.protocol import DEFAULT_MODEL_NAME, DEFAULT_URL

    # declared here, not at module level: verl loads this file without registering it as a module,
    # where a dataclass cannot resolve its annotations
    @dataclass
    class ScoreFile:
        """``python reward_tts.py``: score a JSONL file by hand; each field is also its option."""
        input: str = option(aliases=("-i",), help="JSONL with 'text' (str) and 'code' (list of ints 0..6560)")
        max_samples: int | None = option(None, aliases=("-n",), help="only the first N rows")
        url: str | None = option(None, help=f"server URL (none: $TTSRL_REWARD_URL or {DEFAULT_URL})")
        model_name: str | None = option(None, help=f"model name (none: $TTSRL_REWARD_MODEL or {DEFAULT_MODEL_NAME})")

    p = argparse.ArgumentParser(description="Score a JSONL of (text, code) rows against the reward server.")
    add_fields(p, ScoreFile)
    a = parse_into(p, ScoreFile, p.parse_args(argv))
    cfg = RewardClientConfig.from_env()
    cfg.url = (a.url or cfg.url).rstrip("/")
    cfg.model = a.model_name or cfg.model
    cfg.max_fail_fraction = 1.0  # by hand: report failures per line instead of stopping

    rows = []
    try:
        for where, row in iter_objects(a.input):  # the project's one JSONL reader: errors name FILE:LINE
            text, code = row.get("text"), row.get("code")
            if not isinstance(text, str) or not isinstance(code, list) or \
                    not all(isinstance(c, int) and not isinstance(c, bool) for c in code):
                raise ValueError(f"{where}: 'text' must be a string and 'code' a list of integers")
            rows.append((int(where.rsplit(":", 1)[1]), code, text))
            if a.max_samples is not None and len(rows) >= a.max_samples:
                break
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    results = asyncio.run(score_all([(c, t) for _, c, t in rows], cfg))
    failed = 0
    for (lineno, code, text), r in zip(rows, results):
        failed += r["reward_failed"] > 0
        status = "FAILED" if r["reward_failed"] else f"{r['score']:.4f}"
        sim = f"{r['sim']:.3f}" if r["sim_measured"] else "-"  # absent, not 0: the server measured none
        print(f"line {lineno}\treward {status}\terror_rate {r['error_rate']:.3f}\tsim {sim}\t"
              f"tokens {len(code)}\ttext {text}\ttranscript {r['transcript']}")
    print(f"{len(rows)} rows, {failed} failed, {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
