#!/usr/bin/env python
"""The speech head's cost: the full biased product then the mask (what ``SpeechHead`` did before
2026-12-02) against the speech rows only (``ttsrl.model.modeling_cosyvoice2.SpeechHead``), forward
and backward of a log-softmax loss gathered at speech ids, as verl's actor takes it. Two sizes: the
embedded model's head (hidden 128, 7,808 rows) and CosyVoice2-0.5B's (hidden 896, speech ids from
151,663 as ``ttsrl.model.vocab`` lays them out, 158,336 rows with the converter's padding; --full). Prints seconds per variant, repeated, and the
largest difference in logits and in the weight gradient.

    python benchmarks/bench_speech_head.py --tokens 4096 --repeats 3
    python benchmarks/bench_speech_head.py --full --tokens 1024
"""

from __future__ import annotations

import argparse
import time

import torch

from ttsrl.model import vocab as V
from ttsrl.model.modeling_cosyvoice2 import MASKED_LOGIT, SpeechHead


def full_then_mask(head: SpeechHead, hidden: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
    start, end = head.output_range
    ids = torch.arange(logits.shape[-1])
    return logits.masked_fill((ids < start) | (ids >= end), MASKED_LOGIT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="CosyVoice2-0.5B's head instead of the embedded model's")
    p.add_argument("--tokens", type=int, default=4096, help="positions in the micro-batch (batch x length)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    # the released model's first speech id (vocab.py), the embedded model's (its 1,233 text ids)
    hidden_size, sv = (896, V.SpeechVocab(151_663)) if a.full else (128, V.SpeechVocab(1_233))
    rows, (start, end) = sv.padded_vocab_size, sv.output_range
    torch.manual_seed(0)
    head = SpeechHead(hidden_size, rows, (start, end))
    hidden = torch.randn(a.tokens, hidden_size, requires_grad=True)
    target = torch.randint(start, end, (a.tokens,))
    print(f"head {hidden_size} x {rows} ({end - start} speech rows), {a.tokens} positions, "
          f"{torch.get_num_threads()} threads")
    kept = {}
    for name, fn in (("full product, then mask", full_then_mask), ("speech rows only", SpeechHead.forward)):
        times = []
        for _ in range(a.repeats):
            head.zero_grad()
            t0 = time.perf_counter()
            out = fn(head, hidden)
            loss = -out.log_softmax(-1).gather(-1, target[:, None]).mean()
            loss.backward()
            times.append(time.perf_counter() - t0)
        kept[name] = (out.detach(), head.weight.grad.clone())
        print(f"{name:>24}: " + "  ".join(f"{t:.3f}" for t in times) + " s (forward + backward)")
    (l0, g0), (l1, g1) = kept.values()
    print(f"largest difference: logits {(l0 - l1).abs().max().item():.2e}, weight gradient {(g0 - g1).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
