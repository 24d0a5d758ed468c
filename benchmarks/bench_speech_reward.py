"""Real-speech reward throughput on CPU: rollouts scored a second by the kokoro backend (Kokoro-82M ->
Whisper-base, + Resemblyzer SIM, + DNSMOS), a batch at a time against one at a time, what Whisper's
fitted window (``--whisper-fit-window``) changes in speed and in the error rate, and what Kokoro's
convolutions as integer matrix products (``int8_convs``, used where exact) save against the int8
export's own ConvInteger graph.

    .venv/bin/python benchmarks/bench_speech_reward.py [--n 32] [--threads 2] [--batch 16]

The rollouts are misaki's phonemes of the first N sentences of data/corpus/test.jsonl without Latin
letters, each voiced by a voice chosen by its index (the five in turn). Reports, per setting, the
seconds a rollout and rollouts a second, each stage's share, and the utterance-mean CER (Whisper-base,
ttsrl.text normaliser, capped at 1) so the fitted window's figure can be compared with the full
one's. Numbers only, no pass/fail; nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ttsrl.families.kokoro.phonemes import MandarinG2P, load_vocab  # noqa: E402
from ttsrl.reward.backends import BackendConfig, build_pipeline  # noqa: E402
from ttsrl.reward.backends.int8_convs import exact_u8s8_gemm  # noqa: E402
from ttsrl.reward.backends.kokoro import KokoroConfig, KokoroToken2Wav  # noqa: E402
from ttsrl.stats import bootstrap_mean  # noqa: E402
from ttsrl.text import cer  # noqa: E402


def rollouts(n: int):
    g2p, vocab = MandarinG2P(), load_vocab()
    texts = [json.loads(line)["text"] for line in (ROOT / "data/corpus/test.jsonl").read_text().splitlines()]
    texts = [t for t in texts if g2p.reads(t)][:n]
    voices = [vocab.voices[i % len(vocab.voices)] for i in range(len(texts))]
    return texts, [vocab.encode(g2p(t)) for t in texts], voices


def mean_ci(values) -> tuple[float, float, float]:
    lo, hi = bootstrap_mean(values)
    return float(np.mean(values)), lo, hi


def run(pipeline, texts, codes, voices, batch: int):
    stages: dict[str, float] = {}
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        out += pipeline.transcribe_tokens(codes[i:i + batch], texts[i:i + batch], prompt_ids=voices[i:i + batch])
        for k, v in pipeline.last_stage_seconds.items():
            stages[k] = stages.get(k, 0.0) + v
    total = time.perf_counter() - t0
    rates = [min(1.0, cer(t, o.text)) for t, o in zip(texts, out)]
    return total, stages, rates, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="rollouts (test sentences)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each backend")
    ap.add_argument("--batch", type=int, default=16, help="rollouts a batch in the batched runs")
    ap.add_argument("--tones-only", action="store_true", help="only the tone probe")
    a = ap.parse_args()
    texts, codes, voices = rollouts(a.n)
    if a.tones_only:
        return tone_probe(texts, codes, voices, a)
    print(f"{len(texts)} rollouts, {np.mean([len(c) for c in codes]):.1f} phoneme codes each, "
          f"{a.threads} threads, batches of {a.batch}")
    matmuls = exact_u8s8_gemm()
    print(f"Kokoro's convolutions: {'as integer matrix products' if matmuls else 'the export ConvInteger graph'} "
          f"by default on this CPU ({'VNNI' if matmuls else 'no VNNI: the u8 x s8 product is not exact'})")
    settings = [  # (label, fit window, SIM, MOS, batch, the export's ConvInteger graph)
        ("CER, full window, one at a time", False, False, False, 1, False),
        ("CER, full window, batched", False, False, False, a.batch, False),
        ("CER, fitted window, one at a time", True, False, False, 1, False),
        ("CER, fitted window, batched", True, False, False, a.batch, False),
        ("CER + SIM, fitted window, batched", True, True, False, a.batch, False),
        ("CER + SIM + DNSMOS, fitted window, batched", True, True, True, a.batch, False),
    ]
    if matmuls:
        settings.insert(4, ("  the same, ConvInteger graph", True, False, False, a.batch, True))
    rates_by = {}
    for label, fit, sim, mos, batch, convinteger in settings:
        pipe = build_pipeline(BackendConfig(backend="kokoro", want_sim=sim, want_mos=mos, whisper_fit_window=fit,
                                            cpu_threads=a.threads))
        if convinteger:
            pipe.token2wav = KokoroToken2Wav(KokoroConfig(cpu_threads=a.threads, conv_matmuls=False))
        if sim:  # the voices' reference embeddings are made once a machine: not a rollout's cost
            for v in set(voices):
                pipe.token2wav.reference(v)
        run(pipe, texts[:2], codes[:2], voices[:2], 2)  # warm-up
        total, stages, rates, out = run(pipe, texts, codes, voices, batch)
        rates_by.setdefault((fit, batch), rates)
        m, lo, hi = mean_ci(rates)
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in stages.items())
        extra = ""
        if sim:
            extra += f"; SIM {np.mean([o.sim for o in out if o.sim is not None]):.3f}"
        if mos:
            extra += f"; DNSMOS OVRL {np.mean([o.mos.ovrl for o in out if o.mos is not None]):.2f}"
        if convinteger:
            extra += f"; the same transcripts as the matmul graph: {rates == rates_by[(fit, batch)]}"
        print(f"{label:44s} {total / len(texts):.3f} s/rollout = {len(texts) / total:.2f} rollouts/s "
              f"({shares}); CER {100 * m:.2f}% [{100 * lo:.2f}, {100 * hi:.2f}]{extra}")
    full, fitted = np.array(rates_by[(False, a.batch)]), np.array(rates_by[(True, a.batch)])
    d, lo, hi = mean_ci(list(fitted - full))
    print(f"fitted - full window CER, paired over {len(full)} rollouts: {100 * d:+.2f} points [{100 * lo:+.2f}, "
          f"{100 * hi:+.2f}]; same transcript in {np.mean(fitted == full):.0%} by rate")
    tone_probe(texts, codes, voices, a)


def tone_probe(texts, codes, voices, a) -> None:
    """What Whisper-base hears of tones: each rollout again with 20% of its tone arrows changed to
    another tone, against the correct one (full window, batched)."""
    vocab, rng = load_vocab(), np.random.default_rng(0)
    arrows = [vocab.symbols.index(c) for c in "→↗↓↘"]
    changed = []
    for c in codes:
        c = list(c)
        at = [i for i, x in enumerate(c) if x in arrows]
        for i in rng.choice(at, size=max(1, round(0.2 * len(at))), replace=False):
            c[i] = int(rng.choice([x for x in arrows if x != c[i]]))
        changed.append(c)
    pipe = build_pipeline(BackendConfig(backend="kokoro", cpu_threads=a.threads))
    _, _, right, _ = run(pipe, texts, codes, voices, a.batch)
    _, _, wrong, _ = run(pipe, texts, changed, voices, a.batch)
    d, lo, hi = mean_ci(list(np.array(wrong) - np.array(right)))
    print(f"tones: 20% of tone arrows changed: CER {100 * np.mean(wrong):.2f}% against {100 * np.mean(right):.2f}% "
          f"correct (full window); paired difference {100 * d:+.2f} points [{100 * lo:+.2f}, {100 * hi:+.2f}]; "
          f"higher in {np.mean(np.array(wrong) > np.array(right)):.0%}, lower in "
          f"{np.mean(np.array(wrong) < np.array(right)):.0%} of {len(right)} pairs")


if __name__ == "__main__":
    main()
