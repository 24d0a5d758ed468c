"""Do observed draws fit an exact distribution? Pearson's chi-square, for the sampling tests.

Outcomes whose expected count is under ``MIN_EXPECTED`` are pooled into one cell
together with the mass the exact distribution leaves unlisted; a pooled cell still too
small joins the smallest listed one. With ``complete`` (``probs`` names every outcome
that has mass) an outcome drawn outside them fails outright. Used by tests/test_cosyvoice_lm.py (``pick_token`` draws)
and tests/gpu_stack/test_vllm_sampling.py (vLLM draws).
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable, Mapping

import torch

MIN_EXPECTED = 5.0
ALPHA = 1e-3  # the tests are seeded: a fit below this is a failure, not bad luck to retry


def chi_square(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of ``counts`` against ``probs`` (which may
    sum to less than 1: the rest is the pooled cell's)."""
    n = sum(counts.values())
    listed = sorted((k for k, p in probs.items() if n * p >= MIN_EXPECTED), key=lambda k: probs[k])
    cells = [[counts.get(k, 0), n * probs[k]] for k in listed]
    rest = [n - sum(o for o, _ in cells), n * (1.0 - sum(probs[k] for k in listed))]
    if rest[1] >= MIN_EXPECTED or not cells:
        cells.append(rest)
    else:  # too small on its own: merged into the smallest listed cell
        cells[0] = [cells[0][0] + rest[0], cells[0][1] + max(rest[1], 0.0)]
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    if df < 1:
        return stat, df, 1.0
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def assert_fits(draws: Iterable[Hashable] | Mapping[Hashable, int], probs: Mapping[Hashable, float],
                label: str = "", complete: bool = True) -> float:
    """Fail unless the draws could come from ``probs`` (chi-square p >= ALPHA); the p-value."""
    counts = Counter(draws) if not isinstance(draws, Mapping) else Counter(dict(draws))
    impossible = {k: c for k, c in counts.items() if probs.get(k, 0.0 if complete else None) == 0.0}
    assert not impossible, f"{label}: drawn outcomes the distribution excludes: {impossible}"
    stat, df, p = chi_square(counts, probs)
    print(f"[draws] {label}: n={sum(counts.values())} chi2={stat:.1f} df={df} p={p:.3g}")
    assert p >= ALPHA, (f"{label}: draws do not fit (chi2 {stat:.1f}, df {df}, p {p:.2g}); most common "
                        f"{counts.most_common(8)}; expected top {sorted(probs.items(), key=lambda kv: -kv[1])[:8]}")
    return p
