#!/usr/bin/env python
"""Stage 4's transformers engine (``ttsrl.model.generate.HFGenerator``, what ``infer_dataset.py``
samples with on a GPU by default) on one device: speech codes generated a second, by dtype and
batch size, and how far its codes agree with the same engine on the CPU in fp32.

Requests: the first N utterances of a test set (any layout stage 4 reads: JSONL, Seed-TTS, CV3-Eval).
A set without prompts of its own gets one on every other utterance (the set's next text as the
prompt's transcript, 50 prompt codes drawn from a fixed seed), so both CosyVoice2 input layouts
are exercised. Sampling is
CosyVoice's rule (``SamplingConfig``'s defaults, ``--greedy`` for argmax); the CPU reference uses
the same per-utterance seeds, so sampled codes differ from it only where float rounding in the
model changes a draw. Agreement: utterances whose codes are identical, and the mean share of the
codes before the first difference.

    python benchmarks/bench_hf_engine.py --model-dir exp/embedded/hf_model
    python benchmarks/bench_hf_engine.py --model-dir HF --device cuda --dtypes float32,bfloat16 \\
        --batch-sizes 1,16,64 --n 64 --compare 8      (scripts/gpu_hf_check.sh, full size on a GPU)
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from ttsrl.data.testsets import TestSetError, Utterance, read_test_set
from ttsrl.model import generate as G
from ttsrl.model.cosyvoice_lm import SamplingConfig
from ttsrl.model.hf_model import load_speech_lm

REPO = Path(__file__).resolve().parents[1]


def utterances(path: str, n: int, prompt_codes: int, codebook: int) -> list[Utterance]:
    try:
        utts = read_test_set("bench", path).utterances
    except TestSetError as e:  # names the file and line
        raise SystemExit(str(e)) from None
    if len(utts) < n + 1:
        raise SystemExit(f"{path}: {len(utts)} utterances, --n {n} needs {n + 1}")
    if any(u.prompt_speech for u in utts):  # the set's own prompts
        return utts[:n]
    rng = random.Random(0)
    return [replace(u, prompt_text=utts[n].text, prompt_speech=tuple(rng.randrange(codebook) for _ in range(prompt_codes)))
            if i % 2 else u for i, u in enumerate(utts[:n])]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(lm, reqs, batch_size: int, greedy: bool, device: str) -> tuple[list[G.Generated], float]:
    gen = G.HFGenerator(lm.model, lm.vocab, pad_id=lm.tokenizer.pad_token_id)
    cfg = G.GenerationConfig(greedy=greedy, sampling=SamplingConfig(), batch_size=batch_size)
    sync(device)
    t0 = time.perf_counter()
    out = gen.generate(reqs, cfg)
    sync(device)
    return out, time.perf_counter() - t0


def agreement(a: list[G.Generated], b: list[G.Generated]) -> tuple[int, float]:
    same, prefix = 0, []
    for x, y in zip(a, b):
        same += x.codes == y.codes and x.stopped == y.stopped
        k = next((i for i, (p, q) in enumerate(zip(x.codes, y.codes)) if p != q), min(len(x.codes), len(y.codes)))
        prefix.append(k / max(len(x.codes), len(y.codes), 1))
    return same, sum(prefix) / max(len(prefix), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="a converted or merged HF checkpoint (stage -1 or 3)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtypes", default="float32", help="comma-separated weight dtypes (float32, bfloat16, float16)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated utterances per batch")
    p.add_argument("--n", type=int, default=16, help="utterances per timed run")
    p.add_argument("--texts", default=str(REPO / "data/corpus/test.jsonl"),
                   help="a test set: JSONL with 'text', a Seed-TTS meta.lst or folder, a CV3-Eval folder")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of CosyVoice's sampling")
    p.add_argument("--compare", type=int, default=0,
                   help="also decode the first K utterances on the CPU in fp32 and report agreement (0: skip)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = "cuda:0" if a.device == "cuda" else a.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: torch {torch.__version__} sees no GPU")
    probe = load_speech_lm(a.model_dir)
    reqs = G.make_requests(probe.tokenizer, utterances(a.texts, a.n, 50, probe.vocab.speech_token_size))
    n_params = sum(t.numel() for t in probe.model.parameters())
    print(f"[hf_engine] {a.model_dir}: {n_params / 1e6:.1f}M parameters, {len(reqs)} utterances "
          f"({sum(1 for r in reqs if r.prompt_speech)} zero-shot), {'greedy' if a.greedy else 'sampled'}, "
          f"device {dev}{' ' + torch.cuda.get_device_name(dev) if dev.startswith('cuda') else ''}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    reference = None
    if a.compare:
        reference, secs = run(probe, reqs[:a.compare], min(a.compare, 8), a.greedy, "cpu")
        print(f"[hf_engine] reference: cpu float32, {a.compare} utterances, "
              f"{sum(len(g.codes) for g in reference)} codes in {secs:.1f}s")
    del probe
    for dtype in a.dtypes.split(","):
        lm = load_speech_lm(a.model_dir, dtype=getattr(torch, dtype), device=dev)
        run(lm, reqs[:2], 2, a.greedy, dev)  # warm-up (kernels, allocator)
        for bs in (int(b) for b in a.batch_sizes.split(",")):
            if dev.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(dev)
            out, secs = run(lm, reqs, bs, a.greedy, dev)
            codes = sum(len(g.codes) for g in out)
            failed = [g.error for g in out if g.error]
            mem = f", peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB" if dev.startswith("cuda") else ""
            print(f"[hf_engine] {dtype} batch {bs:3d}: {codes} codes in {secs:6.2f}s = {codes / secs:8.1f} codes/s, "
                  f"{sum(g.stopped for g in out)}/{len(out)} stopped, {len(failed)} failed{mem}"
                  + (f" (first: {failed[0]})" if failed else ""))
        if reference is not None:
            out, _ = run(lm, reqs[:a.compare], min(a.compare, 8), a.greedy, dev)
            same, prefix = agreement(out, reference)
            print(f"[hf_engine] {dtype} on {dev} vs cpu float32: {same}/{a.compare} utterances identical, "
                  f"mean {prefix:.0%} of the codes before the first difference")
        del lm
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
