#!/usr/bin/env python
"""token2wav speed with CosyVoice's own code (flow + HiFT): one-by-one vs batched flow.

The model is a random-weight CosyVoice2 folder built with CosyVoice's classes
(tests/cosyvoice2_tiny.py): ``--size full`` has the released model's shapes (the upstream
cosyvoice2.yaml: 6-block conformer encoder, decoder with 256 channels and 12 mid blocks,
HiFT at 512 base channels), ``--size tiny`` the tests' shrunk one; ``--model-dir`` a real
folder. Same 10 Euler steps with classifier-free guidance, same HiFT as the released model.

One pool of utterances (lengths drawn uniformly between --tokens/2 and --tokens, fixed seed);
batch B is the pool's first B. The serial path is timed once per utterance (its time for B
is the sum over the first B), the batched path (``CosyVoiceConfig.batch_flow``) once per B.
Prints utterances/s of each and their ratio, the process CPU seconds of each (the ratio a
machine shared with other work still measures fairly), the flow/HiFT split of the serial
time, and the largest per-sample difference between the two paths' waveforms.

    .venv/bin/python benchmarks/bench_token2wav.py --size full --batch-sizes 1,8,16,32
    .venv/bin/python benchmarks/bench_token2wav.py            # tiny, 1,8,16
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "full"), default="tiny", help="random-weight folder's shapes")
    ap.add_argument("--model-dir", default=None, help="a real CosyVoice2 folder instead of a random one")
    ap.add_argument("--tokens", type=int, default=100, help="longest utterance in speech tokens (25 per second)")
    ap.add_argument("--prompt-seconds", type=float, default=3.0, help="speaker prompt length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", default="1,8,16", help="comma list; the pool is the largest")
    ap.add_argument("--flops", action="store_true", help="also count the flow's FLOPs and the torch ops of one utterance")
    a = ap.parse_args()

    import numpy as np
    import torch
    from cosyvoice2_tiny import build_tiny_cosyvoice2, write_tone_wav

    from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav

    sizes = [int(b) for b in a.batch_sizes.split(",") if b.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = Path(a.model_dir) if a.model_dir else build_tiny_cosyvoice2(Path(tmp) / "m", size=a.size)
        prompts = Path(tmp) / "p"
        prompts.mkdir()
        write_tone_wav(prompts / "spk.wav", a.prompt_seconds, 16000)
        t2w = CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device=a.device))
        name = a.model_dir or f"random-weight {a.size}"
        print(f"model {name}; build + load {time.perf_counter() - t0:.1f} s; torch threads "
              f"{torch.get_num_threads()}; device {a.device}; prompt {a.prompt_seconds} s", flush=True)
        rng = random.Random(0)
        pool = [[rng.randrange(6561) for _ in range(rng.randint(a.tokens // 2, a.tokens))]
                for _ in range(max(sizes))]
        print(f"pool: {len(pool)} utterances of {min(map(len, pool))}-{max(map(len, pool))} tokens", flush=True)
        t2w.synthesize([pool[0][:10]], [None])  # warm-up

        t2w.cfg.batch_flow = False
        serial_s, serial_cpu, serial_wav = [], [], []
        for codes in pool:
            t0, c0 = time.perf_counter(), time.process_time()
            serial_wav.append(t2w.synthesize([codes], [None])[0].waveform)
            serial_s.append(time.perf_counter() - t0)
            serial_cpu.append(time.process_time() - c0)
            print(f"  serial {len(serial_s)}/{len(pool)}: {len(codes)} tokens, {serial_s[-1]:.2f} s wall, "
                  f"{serial_cpu[-1]:.2f} CPU s", flush=True)
        total = sum(serial_s)
        audio = sum(len(w) for w in serial_wav) / t2w.sample_rate
        print(f"serial: {len(pool)} utterances, {audio:.1f} s of audio in {total:.1f} s "
              f"({audio / total:.2f} s audio / s)", flush=True)
        hift_flow = _split(t2w, pool[:2])
        print(f"serial time split (first 2 utterances): flow {hift_flow[0]:.0%}, HiFT {hift_flow[1]:.0%}", flush=True)
        if a.flops:
            gf, ops = _work(t2w, pool[0])
            print(f"work of utterance 0 ({len(pool[0])} tokens + the prompt's): flow {gf:.1f} GFLOP; {ops} torch "
                  "ops called in the whole token2wav", flush=True)

        t2w.cfg.batch_flow = True
        for b in sizes:
            t0, c0 = time.perf_counter(), time.process_time()
            out = t2w.synthesize(pool[:b], [None] * b) if b > 1 else [None]
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if b == 1:  # the batched path is the serial one at batch 1
                wall, cpu, diff = serial_s[0], serial_cpu[0], 0.0
            else:
                diff = max(float(np.max(np.abs(o.waveform - w))) for o, w in zip(out, serial_wav[:b]))
            ser, ser_cpu = b / sum(serial_s[:b]), sum(serial_cpu[:b])
            print(f"batch {b:3d}: serial {ser:6.3f} utt/s, batched flow {b / wall:6.3f} utt/s "
                  f"({b / wall / ser:.2f}x); CPU seconds serial {ser_cpu:7.1f}, batched {cpu:7.1f} "
                  f"({ser_cpu / cpu:.2f}x); max |batched - serial| sample {diff:.2e}", flush=True)


def _work(t2w, codes) -> tuple[float, int]:
    """(flow GFLOP, torch ops called) of one serial utterance: the FLOPs set a GPU's compute
    time, the op count (about one kernel launch each on a GPU) its launch-bound floor. HiFT's
    FLOPs are not counted: torch's FlopCounterMode fails on its weight-norm parametrized convs."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    flow = t2w._model.flow
    original, gflop = flow.inference, []

    def counted(*args, **kw):
        with FlopCounterMode(display=False) as fc:
            out = original(*args, **kw)
        gflop.append(fc.get_total_flops() / 1e9)
        return out
    try:
        flow.inference = counted
        t2w.synthesize([codes], [None])
    finally:
        flow.inference = original
    with Count():
        t2w.synthesize([codes], [None])
    return gflop[0], Count.n


def _split(t2w, codes_list) -> tuple[float, float]:
    """Shares of flow and HiFT in the serial path's time over ``codes_list``."""
    acc: dict = {}
    model = t2w._model
    flow_inf, hift_inf = model.flow.inference, model.hift.inference
    try:
        model.flow.inference = _wrap(flow_inf, acc, "flow")
        model.hift.inference = _wrap(hift_inf, acc, "hift")
        t0 = time.perf_counter()
        for codes in codes_list:
            t2w.synthesize([codes], [None])
        total = time.perf_counter() - t0
    finally:
        model.flow.inference, model.hift.inference = flow_inf, hift_inf
    return acc.get("flow", 0.0) / total, acc.get("hift", 0.0) / total


def _wrap(f, acc: dict, key: str):
    def g(*args, **kw):
        t0 = time.perf_counter()
        try:
            return f(*args, **kw)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    return g


if __name__ == "__main__":
    main()
