"""The speech-token vocabulary: the one place that knows CosyVoice2's token ids.

CosyVoice2's LLM (``Qwen2LM``) predicts one of ``NUM_OUTPUTS`` = 6564 classes:
indices 0..6560 are speech tokens, 6561 is the end of speech, 6562 and 6563 are
further stop tokens (6563 is the "fill" token of bistream training). Its input
side has two learned vectors, ``sos`` and ``task_id``.

In the Hugging Face checkpoint those become ordinary vocabulary entries appended
after the text tokenizer (Qwen's tokenizer plus CosyVoice's own special tokens):

    <|s_0|> .. <|s_6560|>   speech tokens        (LLM index 0..6560)
    <|eos1|>                the real end of speech (LLM index 6561)
    <|eos2|>, <|eos3|>      the other stop tokens (LLM index 6562, 6563)
    <|sos|>, <|task_id|>    the two input-only vectors of ``llm_embedding``

For the released model (Qwen2-0.5B tokenizer) the first speech id is 151663, the
tokenizer has 158229 entries and the embedding is padded to 158336 rows. Nothing
else in the package writes those numbers: everything is derived here from the
tokenizer it is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

SPEECH_TOKEN_SIZE = 6561  # codec vocabulary of CosyVoice2's speech tokenizer
TOKEN_RATE_HZ = 25.0  # speech tokens per second of audio (CosyVoice2's speech tokenizer)
NUM_STOP_TOKENS = 3
NUM_OUTPUTS = SPEECH_TOKEN_SIZE + NUM_STOP_TOKENS  # rows of llm_decoder / speech_embedding
EOS_INDEX = SPEECH_TOKEN_SIZE  # the end-of-speech class CosyVoice2 trains on
STOP_INDICES = tuple(range(SPEECH_TOKEN_SIZE, NUM_OUTPUTS))
SOS_ROW, TASK_ID_ROW = 0, 1  # rows of llm_embedding
PAD_MULTIPLE = 128  # embedding rows are padded to a multiple of this

# Special tokens CosyVoice adds to Qwen's tokenizer at run time, in order
# (cosyvoice/tokenizer/tokenizer.py: QwenTokenizer). The Qwen ones already exist
# in CosyVoice-BlankEN; adding them again is a no-op.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
COSYVOICE_SPECIALS = (
    "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]",
    "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
STOP_TOKEN_NAMES = ("<|eos1|>", "<|eos2|>", "<|eos3|>")
SOS_TOKEN, TASK_ID_TOKEN = "<|sos|>", "<|task_id|>"

_SPEECH_RE = re.compile(r"<\|s_(\d+)\|>")

# User turn: <|sos|> text <|task_id|>; assistant turn: its content verbatim (speech
# tokens). System turns carry nothing CosyVoice2 was trained on and are dropped.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '" + SOS_TOKEN + "' + message['content'] + '" + TASK_ID_TOKEN + "' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def speech_token_name(index: int) -> str:
    """Token string of LLM output class ``index`` (0..6563)."""
    if 0 <= index < SPEECH_TOKEN_SIZE:
        return f"<|s_{index}|>"
    if SPEECH_TOKEN_SIZE <= index < NUM_OUTPUTS:
        return STOP_TOKEN_NAMES[index - SPEECH_TOKEN_SIZE]
    raise ValueError(f"LLM output index {index} outside 0..{NUM_OUTPUTS - 1}")


_NAME_IN_TEXT_RE = re.compile(r"<\|s_\d+\|>|" + "|".join(re.escape(n) for n in STOP_TOKEN_NAMES + (SOS_TOKEN, TASK_ID_TOKEN)))


def speech_token_name_in(text: str) -> str | None:
    """The first name of a speech-vocabulary token spelled in ``text`` (``<|s_12|>``,
    ``<|eos1|>``, ``<|sos|>``, ``<|task_id|>``), which a tokenizer would read as that
    token's id inside the prompt; None when there is none."""
    m = _NAME_IN_TEXT_RE.search(text) if "<|" in text else None
    return m.group(0) if m else None


def added_token_names() -> list[str]:
    """The tokens appended after the text vocabulary, in id order."""
    return [speech_token_name(i) for i in range(NUM_OUTPUTS)] + [SOS_TOKEN, TASK_ID_TOKEN]


def padded_size(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class SpeechVocab:
    """Ids of the speech vocabulary for one text tokenizer.

    ``speech_offset`` is the HF id of ``<|s_0|>`` (= number of text ids).
    """

    speech_offset: int

    # ---- derived ids --------------------------------------------------------
    @property
    def text_vocab_size(self) -> int:
        return self.speech_offset

    @property
    def eos_id(self) -> int:
        return self.speech_offset + EOS_INDEX

    @property
    def stop_ids(self) -> list[int]:
        return [self.speech_offset + i for i in STOP_INDICES]

    @property
    def sos_id(self) -> int:
        return self.speech_offset + NUM_OUTPUTS

    @property
    def task_id(self) -> int:
        return self.speech_offset + NUM_OUTPUTS + 1

    @property
    def tokenizer_size(self) -> int:
        return self.task_id + 1

    @property
    def padded_vocab_size(self) -> int:
        return padded_size(self.tokenizer_size)

    @property
    def output_range(self) -> tuple[int, int]:
        """Half-open HF id range [start, end) the model may ever generate."""
        return self.speech_offset, self.speech_offset + NUM_OUTPUTS

    # ---- maps ----------------------------------------------------------------
    def to_hf(self, index: int) -> int:
        """LLM output index (0..6563) -> HF token id."""
        if not 0 <= index < NUM_OUTPUTS:
            raise ValueError(f"LLM output index {index} outside 0..{NUM_OUTPUTS - 1}")
        return self.speech_offset + index

    def to_index(self, hf_id: int) -> int:
        """HF token id -> LLM output index (0..6563)."""
        index = hf_id - self.speech_offset
        if not 0 <= index < NUM_OUTPUTS:
            raise ValueError(f"token id {hf_id} is not a speech/stop token "
                             f"({self.speech_offset}..{self.speech_offset + NUM_OUTPUTS - 1})")
        return index

    def is_speech(self, hf_id: int) -> bool:
        return 0 <= hf_id - self.speech_offset < SPEECH_TOKEN_SIZE

    def speech_ids_to_codes(self, ids: Iterable[int], stop_at_eos: bool = True) -> list[int]:
        """Generated HF ids -> speech codes 0..6560.

        Stops at the first stop token when ``stop_at_eos``; any non-speech id
        (which a correctly masked model never produces) raises."""
        codes = []
        for t in ids:
            t = int(t)
            if t in self.stop_ids and stop_at_eos:
                break
            codes.append(self.to_index(t))
        if any(c >= SPEECH_TOKEN_SIZE for c in codes):
            raise ValueError("stop token inside a speech sequence")
        return codes

    def codes_to_ids(self, codes: Sequence[int]) -> list[int]:
        out = []
        for c in codes:
            if not 0 <= int(c) < SPEECH_TOKEN_SIZE:
                raise ValueError(f"speech code {c} outside 0..{SPEECH_TOKEN_SIZE - 1}")
            out.append(self.speech_offset + int(c))
        return out

    @staticmethod
    def codes_to_text(codes: Sequence[int]) -> str:
        """Speech codes -> the ``<|s_N|>`` string an assistant turn carries."""
        return "".join(speech_token_name(int(c)) for c in codes)

    @staticmethod
    def parse_speech_text(text: str) -> list[int]:
        """``<|s_12|><|s_7|>...`` -> [12, 7, ...]; anything else is ignored,
        codes outside 0..6560 raise."""
        codes = [int(m) for m in _SPEECH_RE.findall(text)]
        for c in codes:
            if c >= SPEECH_TOKEN_SIZE:
                raise ValueError(f"speech code {c} outside 0..{SPEECH_TOKEN_SIZE - 1}")
        return codes


def text_offset_of(tokenizer) -> int:
    """Number of text ids once CosyVoice's specials are present (= first speech id)."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in COSYVOICE_SPECIALS if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer lacks CosyVoice special tokens {missing[:3]}...")
    return max(vocab[t] for t in COSYVOICE_SPECIALS) + 1


def add_cosyvoice_specials(tokenizer) -> int:
    """Add CosyVoice's run-time special tokens as CosyVoice does; idempotent.

    Returns the number of text ids afterwards."""
    vocab = tokenizer.get_vocab()
    for t in QWEN_SPECIALS:
        if t not in vocab:
            raise ValueError(f"base tokenizer lacks Qwen special token {t!r}; "
                             "is this a Qwen2 (CosyVoice-BlankEN) tokenizer?")
    new = [t for t in COSYVOICE_SPECIALS if t not in vocab]
    if new and len(new) != len(COSYVOICE_SPECIALS):
        raise ValueError(f"tokenizer has only some CosyVoice special tokens (missing {new})")
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:]) + list(COSYVOICE_SPECIALS)},
                                     replace_extra_special_tokens=False)
    return text_offset_of(tokenizer)


def extend_tokenizer(tokenizer) -> SpeechVocab:
    """Give a Qwen tokenizer the full speech vocabulary and chat template.

    Idempotent: a tokenizer that already has them keeps its ids (checked)."""
    offset = add_cosyvoice_specials(tokenizer)
    if len(tokenizer) != offset and len(tokenizer) != offset + NUM_OUTPUTS + 2:
        raise ValueError(f"tokenizer has {len(tokenizer)} entries; expected {offset} "
                         f"(text only) or {offset + NUM_OUTPUTS + 2} (with speech tokens)")
    if len(tokenizer) == offset:
        from tokenizers import AddedToken

        # Speech tokens are NOT special: verl decodes responses with
        # skip_special_tokens=True and the reward must still see them. The stop
        # tokens, sos and task_id are special (never part of a transcript).
        names = added_token_names()
        tokenizer.add_tokens([AddedToken(t, special=i >= SPEECH_TOKEN_SIZE, normalized=False)
                              for i, t in enumerate(names)])
    sv = SpeechVocab(offset)
    check_tokenizer(tokenizer, sv)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = STOP_TOKEN_NAMES[0]
    tokenizer.pad_token = "<|endoftext|>"
    return sv


def check_tokenizer(tokenizer, sv: SpeechVocab) -> None:
    """Raise unless every added token sits at the id ``sv`` says it does."""
    vocab = tokenizer.get_vocab()
    for i, name in enumerate(added_token_names()):
        if vocab.get(name) != sv.speech_offset + i:
            raise ValueError(f"token {name} has id {vocab.get(name)}, expected {sv.speech_offset + i}")
    if len(tokenizer) != sv.tokenizer_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} entries, expected {sv.tokenizer_size}")


def vocab_of(tokenizer) -> SpeechVocab:
    """The SpeechVocab of an already extended tokenizer (checked)."""
    sv = SpeechVocab(text_offset_of(tokenizer))
    check_tokenizer(tokenizer, sv)
    return sv
