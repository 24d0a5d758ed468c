"""Uncertainty of a set's error rate: bootstrap intervals over utterances.

A set's figure is a function of per-utterance numbers (``UttTable``): the mean of the
per-utterance rates (Seed-TTS convention, ``ttsrl.eval.seedtts_eval``) or the pooled rate
(total errors / total reference tokens). Resampling utterances with replacement B times
gives a percentile interval of the figure (``bootstrap``); resampling the SAME
utterance indices for two models scored on the same utterances gives the interval of
their difference and the share of resamples in which one is better (``paired``).
Utterances decoded with several sampling seeds enter as one unit (their rates
averaged, their errors summed), so the interval covers utterance sampling, not seeds.

Resampling is seeded: the same inputs give the same interval on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

METRICS = ("cer_utt_mean", "cer_pooled")
DEFAULT_RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class UttTable:
    """Per utterance: mean rate over seeds, errors and reference tokens summed over seeds."""

    ids: tuple[str, ...]
    rate: np.ndarray
    errors: np.ndarray
    ref_len: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[dict]) -> "UttTable":
        """Rows of results.jsonl (``utt_rate``, ``cer_errors``, ``ref_len``; one per
        utterance and seed), grouped by ``id`` in first-seen order."""
        order: dict[str, list[dict]] = {}
        for r in rows:
            order.setdefault(r["id"], []).append(r)
        ids = tuple(order)
        return cls(ids,
                   np.array([np.mean([r["utt_rate"] for r in order[i]]) for i in ids], dtype=float),
                   np.array([sum(r["cer_errors"] for r in order[i]) for i in ids], dtype=float),
                   np.array([sum(r["ref_len"] for r in order[i]) for i in ids], dtype=float))

    def subset(self, ids: Sequence[str]) -> "UttTable":
        pos = {u: k for k, u in enumerate(self.ids)}
        ix = np.array([pos[u] for u in ids], dtype=int)
        return UttTable(tuple(ids), self.rate[ix], self.errors[ix], self.ref_len[ix])


def figure(t: UttTable, metric: str, ix: np.ndarray | None = None) -> np.ndarray | float:
    """The metric of the set, or of each resample (rows of ``ix``, shape (B, n))."""
    if metric == "cer_utt_mean":
        return t.rate.mean() if ix is None else t.rate[ix].mean(axis=1)
    if metric == "cer_pooled":
        if ix is None:
            return t.errors.sum() / t.ref_len.sum() if t.ref_len.sum() else float(t.errors.sum() > 0)
        e, n = t.errors[ix].sum(axis=1), t.ref_len[ix].sum(axis=1)
        return np.where(n > 0, e / np.maximum(n, 1), (e > 0).astype(float))
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    if n < 1:
        raise ValueError("bootstrap needs at least one utterance")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap(t: UttTable, metric: str, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
              level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of ``metric`` over utterance resamples."""
    return _interval(figure(t, metric, _indices(len(t.ids), resamples, seed)), level)


def bootstrap_mean(values: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                   level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of the mean of per-utterance ``values`` (e.g. speaker similarity)."""
    v = np.asarray(values, dtype=float)
    return _interval(v[_indices(len(v), resamples, seed)].mean(axis=1), level)


def paired_mean(model: dict[str, float], base: dict[str, float], *, resamples: int = DEFAULT_RESAMPLES,
                seed: int = 0, level: float = LEVEL) -> dict | None:
    """Mean of per-utterance values (id -> value) of ``model`` minus ``base`` on the
    utterances both have, resampled together (as :func:`paired`); None when they share none."""
    common = [u for u in base if u in model]
    if not common:
        return None
    m, b = np.array([model[u] for u in common], float), np.array([base[u] for u in common], float)
    ix = _indices(len(common), resamples, seed)
    lo, hi = _interval(m[ix].mean(axis=1) - b[ix].mean(axis=1), level)
    return {"diff": float(m.mean() - b.mean()), "lo": lo, "hi": hi, "n": len(common), "resamples": resamples,
            "level": level}


def paired(model: UttTable, base: UttTable, metric: str, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
           level: float = LEVEL) -> dict:
    """``model`` minus ``base`` on the utterances both scored, resampled together.

    Returns diff (the full-set difference), lo/hi (its interval), p_better (share of
    resamples where ``model`` has the lower error rate), and n (utterances paired)."""
    have = set(model.ids)
    common = [u for u in base.ids if u in have]
    if not common:
        raise ValueError("paired bootstrap: the two models share no utterance")
    m, b = model.subset(common), base.subset(common)
    ix = _indices(len(common), resamples, seed)
    d = figure(m, metric, ix) - figure(b, metric, ix)
    lo, hi = _interval(d, level)
    return {"metric": metric, "diff": float(figure(m, metric) - figure(b, metric)), "lo": lo, "hi": hi,
            "p_better": float(np.mean(d < 0)), "n": len(common), "resamples": resamples, "level": level}


def seed_spread(values: Sequence[float]) -> dict:
    """Mean and spread of one figure across sampling seeds."""
    v = np.asarray(values, dtype=float)
    return {"per_seed": [float(x) for x in v], "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "min": float(v.min()), "max": float(v.max())}
