"""Stage 0's row checks: the text of a row, duplicate forms, prompt lengths, column types.

The rules as the user sees them: docs/architecture.md, "Stage 0's rows".
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa

from ttsrl.jsonl import DataError, Invalid
from ttsrl.limits import text_length_problem
from ttsrl.model.vocab import FAMILIES, SpeechVocab, speech_token_name_in
from ttsrl.text import unreadable

OUTPUT_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
_OUTPUT_COLUMN_SET = frozenset(OUTPUT_COLUMNS)
# Tokens the chat template adds around the text (used by the estimate only).
TEMPLATE_TOKENS = 2  # sos and task_id around the text (every family's template)


# ---------------------------------------------------------------------------
# Row checks
# ---------------------------------------------------------------------------

def extract_text(value: Any) -> tuple[str | None, Invalid | None]:
    """The stripped ``text`` of a parsed row, or (None, why it is invalid)."""
    if not isinstance(value, dict):
        return None, Invalid("not an object", "expected a JSON object with a \"text\" field, "
                                              f"got {_json_kind(value)}")
    if "text" not in value:
        return None, Invalid("missing text", "missing field \"text\" (expected a non-empty string)")
    text = value["text"]
    if not isinstance(text, str):
        return None, Invalid("text not a string",
                             f"field \"text\" must be a string, got {_json_kind(text)}")
    text = text.strip()
    if not text:
        return None, Invalid("empty text", "field \"text\" is empty (expected a non-empty string)")
    if not (text[0].isalnum() or any(ch.isalnum() for ch in text)):
        return None, Invalid("nothing to speak", "field \"text\" has no letter or digit "
                                                 "(nothing to speak)")
    # the reward server and the pair readers refuse the same texts (ttsrl.limits)
    why = text_length_problem(text)
    if why:
        return None, Invalid("text too long", f"field \"text\": {why}")
    why = unreadable(text)
    if why:
        return None, Invalid("unreadable text", f"field \"text\": {why}")
    name = speech_token_name_in(text)
    if name:
        return None, Invalid("speech token in text", f"field \"text\" holds {name!r}, a token of the speech "
                                                     "vocabulary: the prompt would carry its id; remove it")
    if not _OUTPUT_COLUMN_SET.isdisjoint(value):
        clash = next(k for k in OUTPUT_COLUMNS if k in value)
        return None, Invalid("reserved field", f"field {clash!r} clashes with verl's output "
                                               "column of that name; rename it in the input")
    return text, None


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


@cache
def _dedup_table() -> dict[int, None]:
    """Code points removed before comparing texts: whitespace, punctuation, controls."""
    drop = {}
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))
        if cat[0] in "PZ" or cat in ("Cc", "Cf"):
            drop[cp] = None
    return drop


def normalise_for_dedup(text: str) -> str:
    """The form in which two texts count as duplicates (see the module doc)."""
    return unicodedata.normalize("NFKC", text).casefold().translate(_dedup_table())


# ---------------------------------------------------------------------------
# Prompt length
# ---------------------------------------------------------------------------

class PromptLength:
    """Counts the tokens of the rendered chat prompt for a batch of texts."""

    description = ""

    def count(self, texts: list[str]) -> list[int]:
        raise NotImplementedError


class EstimatedPromptLength(PromptLength):
    """Upper bound without a tokenizer: UTF-8 bytes + the template's special tokens."""

    description = "estimated as UTF-8 bytes + 2, an upper bound; --tokenizer counts exactly"

    def count(self, texts: list[str]) -> list[int]:
        return [len(t.encode("utf-8")) + TEMPLATE_TOKENS for t in texts]


class TokenizerPromptLength(PromptLength):
    """Exact count: the tokenizer's chat template as verl applies it.

    verl counts ``apply_chat_template([user turn], add_generation_prompt=True)``.
    When the template puts the text verbatim between a fixed prefix and suffix
    (ours does), the same ids come from tokenising prefix + text + suffix, which
    the fast (Rust) tokenizer does in one batched call; this is checked on a probe
    sentence, and any other template is rendered row by row."""

    _SENTINEL = "\x00TTSRL-TEXT\x00"
    _PROBE = "今天是2024年3月5日, hello world! 重庆的银行行长\n第二行"

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer
            path = Path(tokenizer)
            if not path.is_dir():
                raise DataError(f"--tokenizer {path}: not a directory (expected a Hugging Face "
                                "tokenizer folder, e.g. the converted hf_model/)")
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception as e:  # transformers raises many kinds here
                raise DataError(f"--tokenizer {path}: cannot load a tokenizer: {e}") from e
            self.description = f"counted with the tokenizer in {path}"
        else:
            self.description = "counted with the given tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the tokenizer has no chat template; give the converted model's "
                            "folder (hf_model/), whose tokenizer renders <|sos|> text <|task_id|>")
        self.tokenizer = tokenizer
        rendered = self._render(self._SENTINEL)
        self._affixes = None
        if rendered.count(self._SENTINEL) == 1:
            self._affixes = tuple(rendered.split(self._SENTINEL))
            if self.count([self._PROBE]) != [len(self._exact_ids(self._PROBE))]:
                self._affixes = None

    @property
    def batched(self) -> bool:
        """True when counts come from one batched tokenizer call (the template puts
        the text verbatim between a fixed prefix and suffix)."""
        return self._affixes is not None

    def _messages(self, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    def _render(self, text: str) -> str:
        return self.tokenizer.apply_chat_template(self._messages(text), add_generation_prompt=True,
                                                  tokenize=False)

    def _exact_ids(self, text: str) -> list[int]:
        out = self.tokenizer.apply_chat_template(self._messages(text), add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self._affixes is None:
            return [len(self._exact_ids(t)) for t in texts]
        prefix, suffix = self._affixes
        rendered = [prefix + t + suffix for t in texts]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # the Rust tokenizer
        if backend is not None:  # same ids (checked on the probe), without Python overhead
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [len(e.ids) for e in encode(rendered, add_special_tokens=False)]
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]


def make_prompt_length(tokenizer: Any) -> PromptLength:
    return EstimatedPromptLength() if tokenizer is None else TokenizerPromptLength(tokenizer)


# ---------------------------------------------------------------------------
# Zero-shot rows: the pool prompt of a row and its prompt length
# ---------------------------------------------------------------------------

# The longest system prefix of any family, in UTF-8 bytes: the estimate stays an upper
# bound whichever family's template renders the row.
_PREFIX_BYTES = max(len(f.system_prefix.encode("utf-8")) for f in FAMILIES.values())
# Why a row's walk passed a pool prompt by (the summary counts them).
SKIP_SAME_TEXT = "its transcript is the row's text"
SKIP_BOUNDARY = "the template's tokenisation merges it with the text"
SKIP_TOO_LONG = "over --max_prompt_length with it"


def zero_shot_messages(prompt_text: str, text: str, speech: Sequence[int]) -> list[dict[str, str]]:
    """A zero-shot row's verl prompt: one user turn, the prompt's transcript then the text
    (the chat template renders ``<|sos|>`` + system prefix + content + ``<|task_id|>``), and an
    assistant turn holding the prompt's speech as ``<|s_N|>`` tokens, rendered verbatim after
    task_id. The rollout continues that assistant turn: the response is the continuation only."""
    return [{"role": "user", "content": prompt_text + text},
            {"role": "assistant", "content": SpeechVocab.codes_to_text(speech)}]


@dataclass
class ZeroShotChoice:
    """The pool prompt chosen for a row (its position in the id-sorted pool), the row's prompt
    tokens with it, and why earlier candidates were passed by."""

    position: int | None
    tokens: int
    skipped: list[str]


class ZeroShotPrompts:
    """Chooses each row's prompt from a pool and counts the row's prompt tokens.

    Rule (stable for a pool, seed and input): row ``index`` of ``split`` (its 0-based
    position in the output file) starts at ``prompt_pool.first_choice(seed, split, index)``
    in the pool sorted by id and walks on, cyclically, past every prompt whose transcript is
    the row's text (after ``normalise_for_dedup``), or with which the row's prompt would not
    fit ``max_prompt_length``, or (with a tokenizer) for which the chat template's rendering,
    tokenised as verl tokenises it (``apply_chat_template(..., tokenize=True)``, in one piece),
    differs from CosyVoice's zero-shot input (transcript and text tokenised each on its own,
    ``ttsrl.model.generate.build_input_ids``): a byte-level BPE can merge the transcript's
    last characters with the text's first. No candidate left: the row is invalid.

    Prompt length: with a tokenizer, the exact ids; without one, an upper bound (UTF-8 bytes
    of the transcript and the text, the longest family system prefix, sos and task_id, one
    token per speech code)."""

    def __init__(self, pool, seed: int, tokenizer: Any, max_prompt_length: int):
        self.pool = pool
        self.seed = seed
        self.max_prompt_length = max_prompt_length
        self.tokenizer = tokenizer
        self._forms = [normalise_for_dedup(p.prompt_text) for p in pool.prompts]
        if tokenizer is not None:
            from ttsrl.model import vocab as V

            try:
                self.vocab = V.vocab_of(tokenizer)
            except ValueError as e:
                raise DataError(f"--tokenizer: {e}") from None
            self._prompt_ids: dict[str, tuple[int, ...]] = {}

    @property
    def description(self) -> str:
        if self.tokenizer is None:
            return ("estimated as UTF-8 bytes of transcript and text + the longest system prefix + 2 + the speech "
                    "tokens, an upper bound; --tokenizer counts exactly")
        return "counted exactly: sos, transcript, text, task_id and the prompt's speech tokens"

    def _enc(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    def exact_ids(self, prompt, text: str) -> list[int]:
        """CosyVoice's zero-shot LLM input for ``text`` with ``prompt``, as stage 4 builds it
        (``make_requests``: the family's system prefix and the transcript tokenised together,
        the text on its own; ``build_input_ids``). The transcript's ids are kept per prompt:
        ``make_requests`` itself reads the whole vocabulary on every call."""
        from ttsrl.model.generate import Request, build_input_ids

        head = self._prompt_ids.get(prompt.id)
        if head is None:
            head = self._prompt_ids[prompt.id] = self._enc(self.vocab.family.system_prefix + prompt.prompt_text)
        return build_input_ids(self.vocab, Request(prompt.id, self._enc(text), head, prompt.speech))

    def verl_ids(self, prompt, text: str) -> list[int]:
        """The ids verl 0.9.1's agent loop gives the rollout for the row's messages."""
        out = self.tokenizer.apply_chat_template(zero_shot_messages(prompt.prompt_text, text, prompt.speech),
                                                 add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def choose(self, split: str, index: int, text: str) -> ZeroShotChoice:
        from ttsrl.data.prompt_pool import first_choice

        n = len(self.pool)
        start = first_choice(self.seed, split, index, n)
        form = normalise_for_dedup(text)
        skipped: list[str] = []
        shortest = None
        for k in range(n):
            pos = (start + k) % n
            prompt = self.pool.prompts[pos]
            if self._forms[pos] == form:
                skipped.append(SKIP_SAME_TEXT)
                continue
            if self.tokenizer is None:
                tokens = (len(prompt.prompt_text.encode("utf-8")) + len(text.encode("utf-8")) + _PREFIX_BYTES
                          + TEMPLATE_TOKENS + len(prompt.speech))
            else:
                ids = self.exact_ids(prompt, text)
                tokens = len(ids)
                if tokens <= self.max_prompt_length and self.verl_ids(prompt, text) != ids:
                    skipped.append(SKIP_BOUNDARY)
                    continue
            if tokens > self.max_prompt_length:
                skipped.append(SKIP_TOO_LONG)
                shortest = tokens if shortest is None else min(shortest, tokens)
                continue
            return ZeroShotChoice(pos, tokens, skipped)
        return ZeroShotChoice(None, shortest or 0, skipped)



# ---------------------------------------------------------------------------
# Extra columns
# ---------------------------------------------------------------------------

_INT64 = (-(1 << 63), (1 << 63) - 1)


def value_kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if _INT64[0] <= v <= _INT64[1] else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"


# Columns whose values are all of one of these kinds keep a native Arrow type.
_NATIVE_TYPES = {
    frozenset(): pa.string(),  # only nulls
    frozenset({"bool"}): pa.bool_(),
    frozenset({"int"}): pa.int64(),
    frozenset({"float"}): pa.float64(),
    frozenset({"int", "float"}): pa.float64(),
    frozenset({"str"}): pa.string(),
}


@dataclass
class ExtraColumn:
    """Kinds of value seen in one extra input column, with a line for each.

    A column that is not native (lists, objects, huge integers, mixed kinds) is a
    string column: strings are stored as they are, every other value as JSON text."""

    name: str
    kinds: dict[str, int] = field(default_factory=dict)  # kind -> first line

    @property
    def native(self) -> bool:
        return frozenset(self.kinds) in _NATIVE_TYPES

    @property
    def arrow_type(self) -> pa.DataType:
        return _NATIVE_TYPES.get(frozenset(self.kinds), pa.string())

    @property
    def mixed(self) -> bool:
        """Values of different kinds (int and float together do not count)."""
        return not self.native and len(self.kinds) > 1

    def convert(self, values: list[Any]) -> pa.Array:
        if not self.native:
            values = [v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                      for v in values]
        return pa.array(values, type=self.arrow_type)
