"""The speech-token vocabulary of each model family: the one place that knows their token ids.

A model family is one :class:`Family` description: the sizes of its speech vocabulary,
its stop set, where its two input-only vectors (sos, task_id) live, whether its head has
a bias, its prompt format and the family details of its sampling rule. Every consumer
(conversion, the HF and vLLM classes, verl's rollout, stage 0, the reward protocol, the
sweep, mining, export) reads them from here, through the :class:`SpeechVocab` of a
tokenizer (:func:`vocab_of` finds the family from the tokenizer's own entries) or by
name (:func:`family`). No other module writes a family's numbers.

**cosyvoice2** (CosyVoice2-0.5B, ``Qwen2LM``): the LLM predicts one of 6564 classes:
0..6560 speech tokens, 6561 the end of speech, 6562 and 6563 further stop tokens (6563
is the "fill" token of bistream training). Its input side has two learned vectors,
``llm_embedding`` rows 0 (sos) and 1 (task_id). In the Hugging Face checkpoint they
become vocabulary entries appended after the text tokenizer (Qwen's plus CosyVoice's
specials)::

    <|s_0|> .. <|s_6560|>   speech tokens        (LLM index 0..6560)
    <|eos1|>                the real end of speech (LLM index 6561)
    <|eos2|>, <|eos3|>      the other stop tokens (LLM index 6562, 6563)
    <|sos|>, <|task_id|>    the two input-only vectors of ``llm_embedding``

For the released model (Qwen2-0.5B tokenizer) the first speech id is 151663, the
tokenizer has 158229 entries and the embedding is padded to 158336 rows.

**cosyvoice3** (Fun-CosyVoice3-0.5B-2512, ``CosyVoice3LM`` at FunAudioLLM/CosyVoice
ace7c47, cosyvoice/llm/llm.py): no ``llm_embedding``; ``speech_embedding`` and the
bias-free ``llm_decoder`` have 6761 rows (speech_token_size + 200): 0..6560 speech,
6561 sos, 6562 the end of speech, 6563 task_id, 6564 fill, 6565..6760 unused; every
index >= 6561 stops (its ``stop_token_ids``). All 6761 rows map to HF entries::

    <|s_0|> .. <|s_6560|>   speech tokens (0..6560)
    <|sos|> <|eos|> <|task_id|> <|fill|>   6561..6564 (sos and task_id are also inputs)
    <|x_6565|> .. <|x_6760|>               the unused stop rows

Its text tokenizer adds ``<|endofsystem|>``, ARPAbet and toned-pinyin tokens after
CosyVoice2's specials (151924 text ids on Qwen2-0.5B's tokenizer), and every text must
hold ``<|endofprompt|>``: prompts start with "You are a helpful assistant.<|endofprompt|>".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PAD_MULTIPLE = 128  # embedding rows are padded to a multiple of this

# Special tokens CosyVoice adds to Qwen's tokenizer at run time, in order
# (cosyvoice/tokenizer/tokenizer.py: CosyVoice2Tokenizer, CosyVoice3Tokenizer). The Qwen ones
# already exist in CosyVoice-BlankEN; adding them again is a no-op.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
COSYVOICE_SPECIALS = (
    "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]",
    "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
# CosyVoice3Tokenizer's list after [mn] (upstream ace7c47): <|endofsystem|>, ARPAbet phones
# with stress digits, and toned pinyin finals/initials, in upstream's order (ids follow it).
_ARPABET = ("AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH "
            "EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW "
            "OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH")
_PINYIN = ("a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng "
           "ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang "
           "ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng "
           "uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng "
           "òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo "
           "ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ")
COSYVOICE3_SPECIALS = COSYVOICE_SPECIALS + ("<|endofsystem|>",) + tuple(
    f"[{t}]" for t in (_ARPABET + " " + _PINYIN).split())
ENDOFPROMPT = "<|endofprompt|>"


@dataclass(frozen=True)
class Family:
    """Everything that differs between model families, as data.

    ``output_names`` names the LLM's non-speech output classes (index ``speech_token_size``
    on); ``input_names`` the input-only vectors appended after them in the HF vocabulary.
    ``sos_name``/``task_id_name`` are among the two. ``min_len_held``: output indices the
    sampling rule sets to -inf before the minimum length (rule "2026" of the family);
    ``stop_indices``: indices that end an utterance when drawn."""

    name: str
    speech_token_size: int
    num_outputs: int
    eos_index: int
    output_names: tuple[str, ...]
    input_names: tuple[str, ...]
    sos_name: str
    task_id_name: str
    head_bias: bool
    specials: tuple[str, ...]
    min_len_held: tuple[int, ...]
    system_prefix: str = ""  # text every LLM input starts with (CosyVoice3's instruction)
    token_rate_hz: float = 25.0  # speech tokens per second of audio
    sample_rate: int = 24000  # token2wav's output rate
    input_embedding: str = "llm_embedding"  # llm.pt tensor holding sos/task_id
    upstream_class: str = "Qwen2LM"
    release: str = ""
    stop_indices: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "stop_indices", tuple(range(self.speech_token_size, self.num_outputs)))
        if len(self.output_names) != self.num_outputs - self.speech_token_size:
            raise ValueError(f"family {self.name}: {len(self.output_names)} output names for "
                             f"{self.num_outputs - self.speech_token_size} non-speech outputs")

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    @property
    def added_names(self) -> tuple[str, ...]:
        """The tokens appended after the text vocabulary, in id order."""
        return tuple(_speech_name(i) for i in range(self.speech_token_size)) + self.output_names + self.input_names

    @property
    def eos_name(self) -> str:
        return self.output_names[self.eos_index - self.speech_token_size]

    def added_index(self, name: str) -> int:
        """Position of ``name`` among :attr:`added_names` (= HF id - speech offset)."""
        if name in self.output_names:
            return self.speech_token_size + self.output_names.index(name)
        return self.num_outputs + self.input_names.index(name)

    @property
    def sos_index(self) -> int:
        return self.added_index(self.sos_name)

    @property
    def task_id_index(self) -> int:
        return self.added_index(self.task_id_name)

    @property
    def chat_template(self) -> str:
        """User turn: sos + system prefix + text + task_id; assistant turn: its content
        verbatim (speech tokens). System turns carry nothing the model was trained on and
        are dropped."""
        return ("{%- for message in messages -%}"
                "{%- if message['role'] == 'user' -%}"
                "{{ '" + self.sos_name + self.system_prefix + "' + message['content'] + '" + self.task_id_name + "' }}"
                "{%- elif message['role'] == 'assistant' -%}"
                "{{ message['content'] }}"
                "{%- endif -%}"
                "{%- endfor -%}")


def _speech_name(code: int) -> str:
    return f"<|s_{code}|>"


def speech_token_name(index: int, fam: "Family | str | None" = None) -> str:
    """Token string of LLM output class ``index`` of the family (default CosyVoice2)."""
    f = family(fam or DEFAULT_FAMILY)
    if 0 <= index < f.speech_token_size:
        return _speech_name(index)
    if f.speech_token_size <= index < f.num_outputs:
        return f.output_names[index - f.speech_token_size]
    raise ValueError(f"LLM output index {index} outside 0..{f.num_outputs - 1}")


COSYVOICE2 = Family(
    name="cosyvoice2", speech_token_size=6561, num_outputs=6564, eos_index=6561,
    output_names=("<|eos1|>", "<|eos2|>", "<|eos3|>"), input_names=("<|sos|>", "<|task_id|>"),
    sos_name="<|sos|>", task_id_name="<|task_id|>", head_bias=True, specials=COSYVOICE_SPECIALS,
    # CosyVoice's sampling_ids at ace7c47 (0e62489): before min_len row speech_token_size is -inf
    min_len_held=(6561,), release="CosyVoice2-0.5B")
COSYVOICE3 = Family(
    name="cosyvoice3", speech_token_size=6561, num_outputs=6761, eos_index=6562,
    output_names=("<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>") + tuple(f"<|x_{i}|>" for i in range(6565, 6761)),
    input_names=(), sos_name="<|sos|>", task_id_name="<|task_id|>", head_bias=False, specials=COSYVOICE3_SPECIALS,
    # Upstream's HF loop inherits CosyVoice2's mask of row 6561, which for CosyVoice3 is sos, so
    # its eos (6562) and the 198 other stops stay drawable before min_len; its vLLM path
    # (min_tokens) holds back every stop id. ttsrl holds back every stop (docs/exactness.md).
    min_len_held=tuple(range(6561, 6761)), system_prefix="You are a helpful assistant." + ENDOFPROMPT,
    input_embedding="speech_embedding", upstream_class="CosyVoice3LM", release="Fun-CosyVoice3-0.5B-2512")
FAMILIES = {f.name: f for f in (COSYVOICE2, COSYVOICE3)}
DEFAULT_FAMILY = COSYVOICE2


def family(name: str | Family) -> Family:
    """The family of this name (a Family passes through)."""
    if isinstance(name, Family):
        return name
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}") from None


# The codec every family shares: speech codes 0..6560 at 25 per second (speech_tokenizer_v2
# and v3 alike). The wire protocol, test sets, pairs and the embedded codec check codes against
# it; a family with another codec must make those read its own (this fails first).
SPEECH_TOKEN_SIZE = COSYVOICE2.speech_token_size
TOKEN_RATE_HZ = COSYVOICE2.token_rate_hz
assert all(f.speech_token_size == SPEECH_TOKEN_SIZE and f.token_rate_hz == TOKEN_RATE_HZ for f in FAMILIES.values())
# CosyVoice2's numbers under their historical names (CosyVoice2 code and tests read them).
NUM_OUTPUTS = COSYVOICE2.num_outputs
NUM_STOP_TOKENS = NUM_OUTPUTS - SPEECH_TOKEN_SIZE
EOS_INDEX = COSYVOICE2.eos_index
STOP_INDICES = COSYVOICE2.stop_indices
SOS_ROW, TASK_ID_ROW = 0, 1  # rows of CosyVoice2's llm_embedding
STOP_TOKEN_NAMES = COSYVOICE2.output_names
SOS_TOKEN, TASK_ID_TOKEN = COSYVOICE2.sos_name, COSYVOICE2.task_id_name
CHAT_TEMPLATE = COSYVOICE2.chat_template

_SPEECH_RE = re.compile(r"<\|s_(\d+)\|>")
_ANY_NAMES = sorted({n for f in FAMILIES.values() for n in f.output_names + f.input_names}, key=len, reverse=True)
_NAME_IN_TEXT_RE = re.compile(r"<\|s_\d+\|>|" + "|".join(re.escape(n) for n in _ANY_NAMES))


def speech_token_name_in(text: str) -> str | None:
    """The first name of a speech-vocabulary token of any family spelled in ``text``
    (``<|s_12|>``, ``<|eos1|>``, ``<|sos|>``, ``<|task_id|>``, ``<|x_6600|>``), which a
    tokenizer would read as that token's id inside the prompt; None when there is none."""
    m = _NAME_IN_TEXT_RE.search(text) if "<|" in text else None
    return m.group(0) if m else None


def added_token_names(fam: Family | str = DEFAULT_FAMILY) -> list[str]:
    """The tokens appended after the text vocabulary, in id order."""
    return list(family(fam).added_names)


def padded_size(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class SpeechVocab:
    """Ids of one family's speech vocabulary for one text tokenizer.

    ``speech_offset`` is the HF id of ``<|s_0|>`` (= number of text ids)."""

    speech_offset: int
    family: Family = DEFAULT_FAMILY

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

    @staticmethod
    def parse_speech_text(text: str, speech_token_size: int = SPEECH_TOKEN_SIZE) -> list[int]:
        """``<|s_12|><|s_7|>...`` -> [12, 7, ...]; anything else is ignored,
        codes outside the speech vocabulary raise."""
        codes = [int(m) for m in _SPEECH_RE.findall(text)]
        for c in codes:
            if c >= speech_token_size:
                raise ValueError(f"speech code {c} outside 0..{speech_token_size - 1}")
        return codes


def text_offset_of(tokenizer, fam: Family | str = DEFAULT_FAMILY) -> int:
    """Number of text ids once the family's specials are present (= first speech id)."""
    f = family(fam)
    vocab = tokenizer.get_vocab()
    missing = [t for t in f.specials if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer lacks {f.name}'s special tokens {missing[:3]}...")
    return max(vocab[t] for t in f.specials) + 1


def add_cosyvoice_specials(tokenizer, fam: Family | str = DEFAULT_FAMILY) -> int:
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


def extend_tokenizer(tokenizer, fam: Family | str = DEFAULT_FAMILY) -> SpeechVocab:
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
