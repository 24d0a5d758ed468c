"""Preference pairs for offline preference optimisation (DPO family, KTO).

One Parquet schema, whoever made the pairs:

    key              string        utterance id (unique per row)
    text             string        the target text
    prompt_ids       list<int64>   HF input ids ``[sos] + text + [task_id]`` (``generate.build_input_ids``)
    chosen           list<int32>   speech codes 0..6560 of the preferred utterance (no stop token)
    rejected         list<int32>   speech codes of the dispreferred one
    chosen_reward    double        reward of ``chosen`` (NaN when unknown, e.g. a real recording)
    rejected_reward  double        reward of ``rejected`` (NaN when unknown)

The trainer (``ttsrl.dpo``) appends the end-of-speech token to both completions, as
CosyVoice2 trains its LM (``lm_target = speech + [eos]``).

Two ways to get such a file:

* :func:`mine_pairs`: sample ``k`` candidates per training text from the current
  model (CosyVoice2's sampling rule, :class:`ttsrl.generate.HFGenerator` on CPU or
  :class:`ttsrl.generate.VLLMGenerator` on GPU), score every candidate through the
  running reward server (:mod:`ttsrl.reward_client`), and keep (best, worst) when
  ``best - worst >= min_margin``. Candidates whose reward request failed or whose
  generation failed are never paired.
* :func:`read_user_pairs`: a JSONL file of user-supplied pairs (e.g. a real
  recording's speech tokens as ``chosen`` and the model's own output as ``rejected``,
  CosyVoice2's own DPO setup), validated line by line with ``FILE:LINE`` errors.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from . import vocab as V
from .atomic import atomic_path
from .jsonl import iter_objects

SCHEMA = pa.schema([
    ("key", pa.string()),
    ("text", pa.string()),
    ("prompt_ids", pa.list_(pa.int64())),
    ("chosen", pa.list_(pa.int32())),
    ("rejected", pa.list_(pa.int32())),
    ("chosen_reward", pa.float64()),
    ("rejected_reward", pa.float64()),
])


class PairsError(ValueError):
    """Bad pair input: the message names the file (and line) and what was expected."""


@dataclass
class Pair:
    key: str
    text: str
    prompt_ids: list[int]
    chosen: list[int]
    rejected: list[int]
    chosen_reward: float = math.nan
    rejected_reward: float = math.nan


@dataclass
class MiningReport:
    texts: int = 0
    texts_with_pairs: int = 0
    candidates: int = 0
    failed_candidates: int = 0
    seconds: float = 0.0
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    margins: list[float] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.texts_with_pairs / self.seconds if self.seconds else float("nan")
        mean_margin = sum(self.margins) / len(self.margins) if self.margins else float("nan")
        return (f"{self.texts_with_pairs} of {self.texts} texts yielded a pair "
                f"({self.candidates} candidates, {self.failed_candidates} failed); "
                f"mean reward margin {mean_margin:.3f}; {self.seconds:.1f} s "
                f"(generate {self.generate_seconds:.1f} s, score {self.score_seconds:.1f} s) = "
                f"{rate:.2f} pairs/s")


def _check_codes(value, where: str, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        raise PairsError(f"{where}: '{name}' must be a list of integer speech codes")
    if not value:
        raise PairsError(f"{where}: '{name}' is empty (a pair needs speech tokens on both sides)")
    bad = [c for c in value if not 0 <= c < V.SPEECH_TOKEN_SIZE]
    if bad:
        raise PairsError(f"{where}: '{name}' holds speech code {bad[0]} outside 0..{V.SPEECH_TOKEN_SIZE - 1}")
    return list(value)


def _reward(value, where: str, name: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PairsError(f"{where}: '{name}' must be a finite number when given")
    return float(value)


def read_user_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """User-supplied pairs, one JSON object a line::

        {"id": "utt1", "text": "...", "chosen": [codes], "rejected": [codes],
         "chosen_reward": 0.9, "rejected_reward": 0.2}

    ``id`` and the rewards are optional. ``prompt_ids`` are built from ``text`` with
    the checkpoint's tokenizer, exactly as mining builds them."""
    sv = V.vocab_of(tokenizer)
    out, seen = [], {}
    for where, obj in iter_objects(path, PairsError):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise PairsError(f"{where}: expected a non-empty string 'text'")
        for need in ("chosen", "rejected"):
            if need not in obj:
                raise PairsError(f"{where}: missing '{need}' (a list of speech codes 0..{V.SPEECH_TOKEN_SIZE - 1})")
        chosen = _check_codes(obj["chosen"], where, "chosen")
        rejected = _check_codes(obj["rejected"], where, "rejected")
        if chosen == rejected:
            raise PairsError(f"{where}: 'chosen' and 'rejected' are the same sequence")
        key = str(obj.get("id", f"pair_{len(out) + 1:06d}"))
        if key in seen:
            raise PairsError(f"{where}: id {key!r} already used at {seen[key]}")
        seen[key] = where
        cr, rr = _reward(obj.get("chosen_reward"), where, "chosen_reward"), _reward(
            obj.get("rejected_reward"), where, "rejected_reward")
        if cr < rr:  # NaN compares False: unknown rewards pass
            raise PairsError(f"{where}: chosen_reward {cr} is below rejected_reward {rr}; swap them")
        text = text.strip()
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = [sv.sos_id] + list(ids) + [sv.task_id]
        out.append(Pair(key, text, prompt, chosen, rejected, cr, rr))
    if not out:
        raise PairsError(f"{path}: no pairs")
    return out


def write_pairs(pairs: Sequence[Pair], path: str | Path) -> Path:
    path = Path(path)
    table = pa.Table.from_pylist([p.__dict__ for p in pairs], schema=SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_pairs(path: str | Path, vocab: V.SpeechVocab | None = None) -> list[Pair]:
    """Read and check a pairs Parquet (either origin)."""
    path = Path(path)
    if not path.is_file():
        raise PairsError(f"{path}: no such pairs file (run the pair-mining stage first)")
    table = pq.read_table(path)
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise PairsError(f"{path}: missing column(s) {missing}; expected {SCHEMA.names}")
    out = []
    for i, row in enumerate(table.select(SCHEMA.names).to_pylist()):
        where = f"{path}: row {i}"
        _check_codes(row["chosen"], where, "chosen")
        _check_codes(row["rejected"], where, "rejected")
        if vocab is not None:
            p = row["prompt_ids"]
            if len(p) < 2 or p[0] != vocab.sos_id or p[-1] != vocab.task_id:
                raise PairsError(f"{where}: prompt_ids must be [sos] + text + [task_id] for this tokenizer")
        out.append(Pair(**{k: (math.nan if row[k] is None and k.endswith("reward") else row[k])
                           for k in SCHEMA.names}))
    if not out:
        raise PairsError(f"{path}: no pairs")
    return out


def choose_pair(rewards: Sequence[float | None], min_margin: float) -> tuple[int, int] | None:
    """(index of the best, index of the worst) candidate when their reward margin is at
    least ``min_margin`` (> 0 always: equal rewards say nothing); ``None`` otherwise.
    ``None`` rewards (failed candidates) are skipped; ties go to the earlier candidate."""
    scored = [(r, i) for i, r in enumerate(rewards) if r is not None and math.isfinite(r)]
    if len(scored) < 2:
        return None
    best = max(scored, key=lambda t: (t[0], -t[1]))
    worst = min(scored, key=lambda t: (t[0], t[1]))
    margin = best[0] - worst[0]
    if margin <= 0 or margin < min_margin:
        return None
    return best[1], worst[1]


def mine_pairs(generator, tokenizer, utts, *, k: int, min_margin: float, gen_cfg, reward_cfg,
               progress: Callable[[int], None] | None = None) -> tuple[list[Pair], MiningReport]:
    """Sample ``k`` candidates per utterance, score them, keep (best, worst) pairs.

    ``generator``: an :class:`~ttsrl.generate.HFGenerator` or ``VLLMGenerator``;
    ``utts``: :class:`ttsrl.evaluate.Utterance` rows (zero-shot prompts allowed);
    candidate ``j`` of utterance ``u`` is seeded by the key ``u.id#j``."""
    from dataclasses import replace

    from .evaluate import make_requests
    from .generate import build_input_ids
    from .reward_client import RequestFailed, request_reward

    if k < 2:
        raise ValueError("k must be at least 2 (a pair needs two candidates)")
    sv = V.vocab_of(tokenizer)
    rep = MiningReport(texts=len(utts))
    t0 = time.time()
    base = make_requests(tokenizer, utts)
    reqs = [replace(r, key=f"{r.key}#{j}") for r in base for j in range(k)]
    gen = generator.generate(reqs, gen_cfg, progress=progress)
    rep.generate_seconds = time.time() - t0
    rep.candidates = len(reqs)

    async def score_all():
        async def one(i):
            g = gen[i]
            if g.error or not g.codes:
                return None
            try:
                r, _, _ = await request_reward(g.codes, utts[i // k].text, reward_cfg)
                return r
            except RequestFailed:
                return None
        return await asyncio.gather(*[one(i) for i in range(len(reqs))])

    t1 = time.time()
    rewards = asyncio.run(score_all())
    rep.score_seconds = time.time() - t1
    rep.failed_candidates = sum(r is None for r in rewards)
    pairs = []
    for u_i, (u, req) in enumerate(zip(utts, base)):
        got = choose_pair(rewards[u_i * k:(u_i + 1) * k], min_margin)
        if got is None:
            continue
        b, w = (u_i * k + j for j in got)
        pairs.append(Pair(u.id, u.text, build_input_ids(sv, req), gen[b].codes, gen[w].codes,
                          float(rewards[b]), float(rewards[w])))
        rep.margins.append(float(rewards[b]) - float(rewards[w]))
    rep.texts_with_pairs = len(pairs)
    rep.seconds = time.time() - t0
    return pairs, rep
