"""A family's speech vocabulary on a text tokenizer: token ids, names and the tokenizer's extension.

The numbers belong to the families (``ttsrl.families``: each family's folder); this module
turns one family's layout into the ids of one tokenizer (:class:`SpeechVocab`), extends a Qwen
tokenizer with it (:func:`extend_tokenizer`) and finds the family an extended tokenizer holds
(:func:`vocab_of`). Every consumer (conversion, the HF and vLLM classes, verl's rollout, stage 0,
the reward protocol, the sweep, mining, export) reads ids through a :class:`SpeechVocab`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ttsrl.families import (
    FAMILIES,
    PAD_MULTIPLE,
    QWEN_SPECIALS,
    Family,
    any_speech_token_size,
    family,
    speech_name,
)

__all__ = ["FAMILIES", "Family", "QWEN_SPECIALS", "SpeechVocab", "add_cosyvoice_specials", "check_tokenizer",
           "extend_tokenizer", "family", "family_of_tokenizer", "padded_size", "parse_speech_text",
           "speech_token_name_in", "text_offset_of", "vocab_of"]

_speech_name = speech_name


_SPEECH_RE = re.compile(r"<\|s_(\d+)\|>")


def _name_in_text_re() -> re.Pattern:
    """Any family's speech-vocabulary names (rebuilt when a family is registered)."""
    names = tuple(sorted({n for f in FAMILIES.values() for n in f.output_names + f.input_names}, key=len, reverse=True))
    if _NAME_RE_CACHE.get("names") != names:
        _NAME_RE_CACHE.update(names=names, re=re.compile(r"<\|s_\d+\|>|" + "|".join(re.escape(n) for n in names)))
    return _NAME_RE_CACHE["re"]


_NAME_RE_CACHE: dict = {}


def speech_token_name_in(text: str) -> str | None:
    """The first name of a speech-vocabulary token of any family spelled in ``text``
    (``<|s_12|>``, ``<|eos1|>``, ``<|sos|>``, ``<|task_id|>``, ``<|x_6600|>``), which a
    tokenizer would read as that token's id inside the prompt; None when there is none."""
    m = _name_in_text_re().search(text) if "<|" in text else None
    return m.group(0) if m else None


def padded_size(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class SpeechVocab:
    """Ids of one family's speech vocabulary for one text tokenizer.

    ``speech_offset`` is the HF id of ``<|s_0|>`` (= number of text ids)."""

    speech_offset: int
    family: Family  # no default: the ids are one family's, and the caller knows which

    # ---- derived ids --------------------------------------------------------
    @property
    def text_vocab_size(self) -> int:
        return self.speech_offset

    @property
    def speech_token_size(self) -> int:
        return self.family.speech_token_size

    @property
    def num_outputs(self) -> int:
        return self.family.num_outputs

    @property
    def eos_index(self) -> int:
        return self.family.eos_index

    @property
    def eos_id(self) -> int:
        return self.speech_offset + self.family.eos_index

    @property
    def stop_ids(self) -> list[int]:
        return [self.speech_offset + i for i in self.family.stop_indices]

    @property
    def sos_id(self) -> int:
        return self.speech_offset + self.family.sos_index

    @property
    def task_id(self) -> int:
        return self.speech_offset + self.family.task_id_index

    @property
    def tokenizer_size(self) -> int:
        return self.speech_offset + len(self.family.added_names)

    @property
    def padded_vocab_size(self) -> int:
        return padded_size(self.tokenizer_size)

    @property
    def output_range(self) -> tuple[int, int]:
        """Half-open HF id range [start, end) the model may ever generate."""
        return self.speech_offset, self.speech_offset + self.family.num_outputs

    # ---- maps ----------------------------------------------------------------
    def to_hf(self, index: int) -> int:
        """LLM output index -> HF token id."""
        if not 0 <= index < self.num_outputs:
            raise ValueError(f"LLM output index {index} outside 0..{self.num_outputs - 1}")
        return self.speech_offset + index

    def to_index(self, hf_id: int) -> int:
        """HF token id -> LLM output index."""
        index = hf_id - self.speech_offset
        if not 0 <= index < self.num_outputs:
            raise ValueError(f"token id {hf_id} is not a speech/stop token "
                             f"({self.speech_offset}..{self.speech_offset + self.num_outputs - 1})")
        return index

    def is_speech(self, hf_id: int) -> bool:
        return 0 <= hf_id - self.speech_offset < self.speech_token_size

    def speech_ids_to_codes(self, ids: Iterable[int], stop_at_eos: bool = True) -> list[int]:
        """Generated HF ids -> speech codes.

        Stops at the first stop token when ``stop_at_eos``; any non-speech id
        (which a correctly masked model never produces) raises."""
        codes = []
        stops = set(self.stop_ids)
        for t in ids:
            t = int(t)
            if t in stops and stop_at_eos:
                break
            codes.append(self.to_index(t))
        if any(c >= self.speech_token_size for c in codes):
            raise ValueError("stop token inside a speech sequence")
        return codes

    def codes_to_ids(self, codes: Sequence[int]) -> list[int]:
        out = []
        n = self.speech_token_size
        for c in codes:
            if not 0 <= int(c) < n:
                raise ValueError(f"speech code {c} outside 0..{n - 1}")
            out.append(self.speech_offset + int(c))
        return out

    @staticmethod
    def codes_to_text(codes: Sequence[int]) -> str:
        """Speech codes -> the ``<|s_N|>`` string an assistant turn carries (every family)."""
        return "".join(_speech_name(int(c)) for c in codes)

    def parse_speech_text(self, text: str) -> list[int]:
        """``<|s_12|><|s_7|>...`` -> [12, 7, ...]; anything else is ignored,
        codes outside the family's speech vocabulary raise."""
        codes = parse_speech_text(text)
        self.family.check_codes(codes)
        return codes


def parse_speech_text(text: str) -> list[int]:
    """``<|s_12|><|s_7|>...`` -> [12, 7, ...] where the family is not known here (verl's reward
    function): anything else is ignored; a code beyond every family's speech vocabulary raises
    (the reward server checks the rest against its own family)."""
    codes = [int(m) for m in _SPEECH_RE.findall(text)]
    n = any_speech_token_size()
    bad = next((c for c in codes if c >= n), None)
    if bad is not None:
        raise ValueError(f"speech code {bad} outside every family's speech vocabulary (0..{n - 1})")
    return codes


def text_offset_of(tokenizer, fam: Family | str) -> int:
    """Number of text ids once the family's specials are present (= first speech id)."""
    f = family(fam)
    vocab = tokenizer.get_vocab()
    missing = [t for t in f.specials if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer lacks {f.name}'s special tokens {missing[:3]}...")
    return max(vocab[t] for t in f.specials) + 1


def add_cosyvoice_specials(tokenizer, fam: Family | str) -> int:
    """Add the family's run-time special tokens as CosyVoice does; idempotent.

    Returns the number of text ids afterwards."""
    f = family(fam)
    vocab = tokenizer.get_vocab()
    for t in QWEN_SPECIALS:
        if t not in vocab:
            raise ValueError(f"base tokenizer lacks Qwen special token {t!r}; "
                             "is this a Qwen2 (CosyVoice-BlankEN) tokenizer?")
    new = [t for t in f.specials if t not in vocab]
    if new and len(new) != len(f.specials):
        raise ValueError(f"tokenizer has only some of {f.name}'s special tokens (missing {new[:5]})")
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:]) + list(f.specials)},
                                     replace_extra_special_tokens=False)
    return text_offset_of(tokenizer, f)


def extend_tokenizer(tokenizer, fam: Family | str) -> SpeechVocab:
    """Give a Qwen tokenizer the family's full speech vocabulary and chat template.

    Idempotent: a tokenizer that already has them keeps its ids (checked)."""
    f = family(fam)
    offset = add_cosyvoice_specials(tokenizer, f)
    n_added = len(f.added_names)
    if len(tokenizer) != offset and len(tokenizer) != offset + n_added:
        raise ValueError(f"tokenizer has {len(tokenizer)} entries; expected {offset} "
                         f"(text only) or {offset + n_added} (with {f.name}'s speech tokens)")
    if len(tokenizer) == offset:
        from tokenizers import AddedToken

        # Speech tokens are NOT special: verl decodes responses with
        # skip_special_tokens=True and the reward must still see them. The stop
        # tokens, sos and task_id are special (never part of a transcript).
        tokenizer.add_tokens([AddedToken(t, special=i >= f.speech_token_size, normalized=False)
                              for i, t in enumerate(f.added_names)])
    sv = SpeechVocab(offset, f)
    check_tokenizer(tokenizer, sv)
    tokenizer.chat_template = f.chat_template
    tokenizer.eos_token = f.eos_name
    tokenizer.pad_token = "<|endoftext|>"
    return sv


def check_tokenizer(tokenizer, sv: SpeechVocab) -> None:
    """Raise unless every added token sits at the id ``sv`` says it does."""
    vocab = tokenizer.get_vocab()
    for i, name in enumerate(sv.family.added_names):
        if vocab.get(name) != sv.speech_offset + i:
            raise ValueError(f"token {name} has id {vocab.get(name)}, expected {sv.speech_offset + i} "
                             f"({sv.family.name} layout)")
    if len(tokenizer) != sv.tokenizer_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} entries, expected {sv.tokenizer_size}")


def family_of_tokenizer(tokenizer) -> Family:
    """The family whose speech vocabulary an extended tokenizer holds: the one whose
    non-speech names all sit right after ``<|s_N-1|>``."""
    vocab = tokenizer.get_vocab()
    for f in FAMILIES.values():
        last = vocab.get(_speech_name(f.speech_token_size - 1))
        if last is not None and all(vocab.get(n) == last + 1 + i
                                    for i, n in enumerate(f.output_names + f.input_names)):
            return f
    names = " or ".join(f"{f.name}'s" for f in FAMILIES.values())
    raise ValueError(f"tokenizer holds no known family's speech vocabulary (no <|s_N|> tokens followed by {names} "
                     "stop names); was it extended by pretrained_to_huggingface.py?")


def vocab_of(tokenizer) -> SpeechVocab:
    """The SpeechVocab of an already extended tokenizer (family found from its entries; checked)."""
    f = family_of_tokenizer(tokenizer)
    sv = SpeechVocab(tokenizer.get_vocab()[_speech_name(0)], f)
    if sv.speech_offset != text_offset_of(tokenizer, f):
        raise ValueError(f"tokenizer's <|s_0|> is id {sv.speech_offset}, but {f.name}'s text specials end at "
                         f"{text_offset_of(tokenizer, f) - 1}")
    check_tokenizer(tokenizer, sv)
    return sv
