#!/usr/bin/env python
"""token2wav speed with CosyVoice's own code (flow + HiFT) on this machine.

The model is the random-weight CosyVoice2 folder of the tests (tests/cosyvoice2_tiny.py):
the released yaml's classes, sample rate and token rate with fewer blocks/channels, so the
number is a lower bound of the cost of the real 0.5B-recipe flow (same 10 Euler steps with
CFG, same HiFT upsampling) scaled down in width. Prints seconds of audio per second, then utterances per second of the
one-by-one path and of the batched flow (``CosyVoice2Config.batch_flow``) at each batch size.

    .venv/bin/python benchmarks/bench_token2wav.py [--tokens 100] [--repeats 3] [--device cpu]
                                                   [--batch-sizes 1,8,16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100, help="speech tokens per utterance (25 per second)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-dir", default=None, help="a real CosyVoice2 folder instead of the tiny one")
    ap.add_argument("--batch-sizes", default="1,8,16", help="serial vs batched flow at these batch sizes ('' = skip)")
    a = ap.parse_args()

    import torch
    from cosyvoice2_tiny import build_tiny_cosyvoice2, write_tone_wav

    from ttsrl.reward.backends.cosyvoice2 import CosyVoice2Config, CosyVoice2Token2Wav

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model_dir) if a.model_dir else build_tiny_cosyvoice2(Path(tmp) / "m")
        prompts = Path(tmp) / "p"
        prompts.mkdir()
        write_tone_wav(prompts / "spk.wav", 3.0, 16000)
        t0 = time.perf_counter()
        t2w = CosyVoice2Token2Wav(CosyVoice2Config(model_dir=str(model), prompt_dir=str(prompts), device=a.device))
        print(f"load: {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
        codes = [(17 * i) % 6561 for i in range(a.tokens)]
        t2w.synthesize([codes[:10]], [None])  # warm-up
        audio_s, wall = 0.0, 0.0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = t2w.synthesize([codes], [None])[0]
            wall += time.perf_counter() - t0
            audio_s += out.duration_s
        print(f"token2wav ({'tiny random' if not a.model_dir else model}) on {a.device}: {a.tokens} tokens x "
              f"{a.repeats}: {audio_s:.1f} s of audio in {wall:.1f} s = {audio_s / wall:.2f} s audio / s")
        for size in [int(b) for b in a.batch_sizes.split(",") if b.strip()]:
            # lengths from --tokens down to half of it: the batched flow pads to the longest
            batch = [codes[:max(1, a.tokens - i * a.tokens // (2 * size))] for i in range(size)]
            rates = {}
            for mode in (False, True):
                t2w.cfg.batch_flow = mode
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    t2w.synthesize(batch, [None] * size)
                rates[mode] = size * a.repeats / (time.perf_counter() - t0)
            print(f"batch {size:3d}: serial {rates[False]:7.2f} utt/s, batched flow {rates[True]:7.2f} utt/s "
                  f"({rates[True] / rates[False]:.2f}x)")


if __name__ == "__main__":
    main()
