"""A simulated speech codec: the embedded CPU preset's "token2wav + ASR".

No neural codec runs here, so the embedded preset replaces speech with a fixed,
invertible code: a sentence becomes its toned pinyin (``ttsrl.text.pinyin``, the
same normalisation the reward uses) and every unit becomes a short pattern of
speech codes in 0..CODE_SPACE-1:

    Chinese syllable   [onset code, final+tone code]       "hao3" -> [O(h, ao), F(ao, 3)]
                        (the onset code names the initial and the final it leads into, as a
                        speech frame's onset carries the vowel that follows; a syllable without
                        an initial has the "zero initial"'s onset; a final+tone has a second
                        code, F2, spoken where its first is among the last REPEAT_WINDOW codes)
    English word       one code per letter a-z, then WORD_END   "ok" -> [L(o), L(k), WORD_END]
    punctuation        PAUSE between the punctuation-delimited phrases of the text

A tiny LM must learn reading (characters -> syllables, polyphones, tone sandhi,
numbers read out) and the code book; the reward is then honest: ``decode`` turns
ANY token stream into a toned-pinyin transcript the reward scores against the text.

Why an onset names its final: a tiny LM finds its place in the text by the code it last wrote.
With an onset per initial, two nearby characters sharing one (音乐 yin1 yue4) sent it back to the
first (yin1 yin1): 13% of its most likely codes were wrong, against 5% with an onset per
(initial, final) pair, which only characters that sound alike share (docs/embedded.md, "Why a
syllable's onset names its final").

Why a final+tone has two codes: a real codec has many tokens for one sound, so CosyVoice's sampling
rule, which blocks a token repeated within its last 10 and draws again, still finds the sound in the
same voice. With one code per final+tone, a final said twice within five syllables (是 shi4 ...
四 si4) could only be drawn again from another voice's book, and a policy trained under that rule
learned to put it there: the voice paid for every repeat (docs/embedded.md, "Why a final+tone has
a second code").

The code book uses 1356 of the 6561 codes, spread over the range by a fixed
permutation (logical index k -> (k * _STRIDE + _OFFSET) mod CODE_SPACE), so it
is the same in every process and Python version (no ``hash()``, no RNG).

Speakers (zero-shot TTS needs a voice to continue). Each of the ``SPEAKERS`` has its
own book: speaker s's code for logical unit k is the permutation's code for k + s * NUM_CODES,
so the four books are disjoint and a code names its speaker (a prompt's codes reveal its voice).
Speaker 0, ``DEFAULT_SPEAKER``, is the voice of text-only TTS. ``decode`` reads every book, but the simulated
ASR hears the default speaker best: a syllable whose final+tone code is another speaker's is
read with a wrong tone with probability ``MISREAD_RATE``, decided by a hash of (speaker,
position, syllable), so the same stream always reads the same and no model can learn which
syllables will be misread. Drifting to the default voice therefore lowers the error rate, the
way CER-only RL drifts the speaker of real TTS models; ``speaker_share`` (the simulated speaker
model's SIM) sees the drift.
"""

from __future__ import annotations

import hashlib
import operator
import re
from dataclasses import dataclass
from string import ascii_lowercase
from typing import Iterable, Sequence

from ttsrl.text import SYLLABLES_PER_SECOND, is_toned_syllable, pinyin, syllables

#: the simulated codec's vocabulary: as large as CosyVoice's speech tokenizers' (v2 and v3), so the
#: LM of a CosyVoice family writes every code; a family with a smaller vocabulary cannot voice it
CODE_SPACE = 6561

INITIALS = ("", "b", "p", "m", "f", "d", "t", "n", "l", "g", "k", "h", "j", "q", "x",
            "zh", "ch", "sh", "r", "z", "c", "s", "y", "w")  # "" = zero initial
FINALS = ("a", "ai", "an", "ang", "ao", "e", "ei", "en", "eng", "er", "g", "i", "ia",
          "ian", "iang", "iao", "ie", "in", "ing", "iong", "iu", "m", "n", "ng", "o",
          "ong", "ou", "u", "ua", "uai", "uan", "uang", "ue", "ui", "un", "uo", "v",
          "ve", "ê")
TONES = (1, 2, 3, 4, 5)
LETTERS = tuple(ascii_lowercase)
N_SILENCE = 4

_STRIDE, _OFFSET = 1021, 1409  # 1021 is prime and not 3: k -> code is a permutation

#: CosyVoice's repetition window (``win_size`` of its sampling rule): a final+tone whose first code is
#: among the last REPEAT_WINDOW codes of an utterance is spoken with its second
REPEAT_WINDOW = 10

# logical layout: silences, onsets (initials x finals, the impossible pairs too: the layout needs no
# list of syllables), finals x tones, letters, the finals' second codes
_SIL0 = 0
_ONS0 = _SIL0 + N_SILENCE
_FIN0 = _ONS0 + len(INITIALS) * len(FINALS)
_LET0 = _FIN0 + len(FINALS) * len(TONES)
_FIN2 = _LET0 + len(LETTERS)
NUM_CODES = _FIN2 + len(FINALS) * len(TONES)

SPEAKERS = ("spk0", "spk1", "spk2", "spk3")
DEFAULT_SPEAKER = SPEAKERS[0]
#: share of a non-default speaker's syllables the simulated ASR reads with a wrong tone: a perfect utterance
#: in another voice scores about 1% CER, so drifting to the default voice pays a little under a CER-only
#: reward, as real ASR favours some voices a little (at 3% a perfect utterance in another voice scored what
#: a real model's whole error is, 1-3%)
MISREAD_RATE = 0.01
assert len(SPEAKERS) * NUM_CODES <= CODE_SPACE  # disjoint books


def _code(k: int, speaker: int = 0) -> int:
    return ((k + speaker * NUM_CODES) * _STRIDE + _OFFSET) % CODE_SPACE


@dataclass(frozen=True)
class Book:
    """One speaker's codes, by unit."""

    speaker: str
    silence: tuple[int, ...]
    onsets: dict
    finals: dict
    letters: dict
    second_finals: dict
    codes: frozenset


def _book(s: int) -> Book:
    return Book(speaker=SPEAKERS[s],
                silence=tuple(_code(_SIL0 + i, s) for i in range(N_SILENCE)),
                onsets={(ini, fin): _code(_ONS0 + i * len(FINALS) + j, s)
                        for i, ini in enumerate(INITIALS) for j, fin in enumerate(FINALS)},
                finals={(fin, tone): _code(_FIN0 + i * len(TONES) + j, s)
                        for i, fin in enumerate(FINALS) for j, tone in enumerate(TONES)},
                letters={ch: _code(_LET0 + i, s) for i, ch in enumerate(LETTERS)},
                second_finals={(fin, tone): _code(_FIN2 + i * len(TONES) + j, s)
                               for i, fin in enumerate(FINALS) for j, tone in enumerate(TONES)},
                codes=frozenset(_code(k, s) for k in range(NUM_CODES)))


BOOKS: dict[str, Book] = {name: _book(s) for s, name in enumerate(SPEAKERS)}
ALL_CODES = frozenset().union(*(b.codes for b in BOOKS.values()))
assert len(ALL_CODES) == len(SPEAKERS) * NUM_CODES

# the default speaker's book under its historical names
_DEFAULT = BOOKS[DEFAULT_SPEAKER]
SILENCE_CODES: tuple[int, ...] = _DEFAULT.silence
PAUSE, WORD_END = SILENCE_CODES[0], SILENCE_CODES[1]  # the other two are never emitted
ONSET_CODES = _DEFAULT.onsets
FINAL_CODES = _DEFAULT.finals
LETTER_CODES = _DEFAULT.letters
USED_CODES = _DEFAULT.codes
assert len(USED_CODES) == NUM_CODES <= CODE_SPACE

# code -> (kind, value) for the decoder; code -> speaker; code -> logical index
_KIND: dict[int, tuple[str, object]] = {}
_SPEAKER_OF: dict[int, str] = {}
_LOGICAL: dict[int, int] = {}
for _s, _name in enumerate(SPEAKERS):
    _b = BOOKS[_name]
    _KIND.update({c: ("silence", None) for c in _b.silence})
    _KIND.update({c: ("onset", pair) for pair, c in _b.onsets.items()})
    _KIND.update({c: ("final", ft) for ft, c in _b.finals.items()})
    _KIND.update({c: ("final", ft) for ft, c in _b.second_finals.items()})
    _KIND.update({c: ("letter", ch) for ch, c in _b.letters.items()})
    _SPEAKER_OF.update({_code(k, _s): _name for k in range(NUM_CODES)})
    _LOGICAL.update({_code(k, _s): k for k in range(NUM_CODES)})
del _s, _name, _b


def speaker_of_code(code: int) -> str | None:
    """The speaker whose book holds ``code`` (None: a code of no book, noise)."""
    return _SPEAKER_OF.get(code)


def unit_of(code: int) -> int:
    """The logical unit (silence, onset, final+tone, letter or a final+tone's second code) a code of
    any book speaks."""
    return _LOGICAL[code]


def first_code_unit(unit: int) -> int:
    """The logical unit of a final+tone's first code for its second (any other unit: itself)."""
    return unit - _FIN2 + _FIN0 if unit >= _FIN2 else unit


def to_speaker(codes: Iterable[int], speaker: str) -> list[int]:
    """The same units in ``speaker``'s voice: every book code mapped to that speaker's code for
    its unit; codes of no book are kept."""
    s = _speaker_index(speaker)
    return [_code(_LOGICAL[c], s) if c in _LOGICAL else c for c in codes]


def _speaker_index(speaker: str) -> int:
    try:
        return SPEAKERS.index(speaker)
    except ValueError:
        raise ValueError(f"unknown simulated speaker {speaker!r}; the speakers are {', '.join(SPEAKERS)}") from None


def speaker_share(codes: Sequence[int], speaker: str) -> float:
    """The simulated speaker model's SIM: the share of ``codes`` that lie in ``speaker``'s book,
    in [0, 1] (0 for no codes). A stream wholly in the prompt's voice scores 1, one that drifted
    to another speaker (or to noise) scores the share it kept."""
    _speaker_index(speaker)
    if not codes:
        return 0.0
    return sum(1 for c in codes if _SPEAKER_OF.get(c) == speaker) / len(codes)


def dominant_speaker(codes: Iterable[int]) -> str | None:
    """The speaker whose book holds the most of ``codes`` (ties: the earlier in ``SPEAKERS``);
    None when no code is in any book. What a prompt's speech tokens reveal."""
    counts = {name: 0 for name in SPEAKERS}
    for c in codes:
        who = _SPEAKER_OF.get(c)
        if who is not None:
            counts[who] += 1
    best = max(SPEAKERS, key=lambda name: (counts[name], -SPEAKERS.index(name)))
    return best if counts[best] else None


def misread_tone(speaker: str, position: int, syllable: str, tone: int) -> int:
    """The tone the simulated ASR hears for ``syllable`` + ``tone`` spoken by ``speaker`` as the
    ``position``-th unit of a transcript: the tone itself for the default speaker; for another,
    a wrong tone with probability MISREAD_RATE (sha256 of speaker, position and syllable: the same
    stream always reads the same, in every process)."""
    if speaker == DEFAULT_SPEAKER:
        return tone
    h = hashlib.sha256(f"{speaker}|{position}|{syllable}{tone}".encode()).digest()
    if int.from_bytes(h[:8], "big") / 2**64 >= MISREAD_RATE:
        return tone
    others = [t for t in TONES if t != tone]
    return others[h[8] % len(others)]


#: nominal token rate to give ``ttsrl.reward.rewards.expected_tokens`` for this codec
#: (2 codes per syllable at SYLLABLES_PER_SECOND syllables per second)
TOKEN_RATE = 2 * SYLLABLES_PER_SECOND

# punctuation that marks a pause; "." and ":" only when not inside a number
_PAUSE_RE = re.compile(r"[，。！？；：、…,!?;]|(?<!\d)[.:]|[.:](?!\d)")


def split_syllable(syl: str) -> tuple[str, str]:
    """Toneless syllable -> (initial, final): "zhuang" -> ("zh", "uang"), "er" -> ("", "er")."""
    for ini in sorted(INITIALS, key=len, reverse=True):
        if ini and syl.startswith(ini) and syl[len(ini):] in FINALS:
            return ini, syl[len(ini):]
    if syl in FINALS:
        return "", syl
    raise ValueError(f"syllable {syl!r} has no initial/final split in the code book")


def _unit_codes(token: str, book: Book) -> list[int]:
    """Codes of one pinyin token; characters outside the code book are skipped."""
    if is_toned_syllable(token):
        ini, fin = split_syllable(token[:-1])
        return [book.onsets[(ini, fin)], book.finals[(fin, int(token[-1]))]]
    letters = [book.letters[ch] for ch in token if ch in book.letters]
    return letters + [book.silence[1]] if letters else []


def encode(text: str, speaker: str = DEFAULT_SPEAKER) -> list[int]:
    """Speech codes of ``text`` in ``speaker``'s voice (book): syllable and word patterns, PAUSE
    at punctuation.

    Pauses go between punctuation-delimited phrases when the phrases' syllable counts
    add up to the whole sentence's (they always do unless a number straddles the
    punctuation); otherwise the sentence is encoded without pauses. Tokens with no
    code (kana, letters outside a-z) are skipped. A final+tone whose code is among the last
    REPEAT_WINDOW codes takes its second code, unless that one is there too.
    """
    book = BOOKS[SPEAKERS[_speaker_index(speaker)]]
    units = pinyin(text)
    counts = [len(pinyin(phrase)) for phrase in _PAUSE_RE.split(text)]
    counts = [n for n in counts if n]
    if sum(counts) != len(units):
        counts = [len(units)]
    codes: list[int] = []
    pos = 0
    for i, n in enumerate(counts):
        if i:
            codes.append(book.silence[0])
        for token in units[pos:pos + n]:
            for c in _unit_codes(token, book):
                window = codes[-REPEAT_WINDOW:]
                kind, value = _KIND[c]
                if kind == "final" and c in window and book.second_finals[value] not in window:
                    c = book.second_finals[value]
                codes.append(c)
        pos += n
    return codes


def decode(tokens: Iterable[int]) -> str:
    """Space-separated toned-pinyin transcript of ANY token stream; never raises.

    Greedy left to right, over every speaker's book: an onset code waits for a final+tone code,
    and its initial with that final becomes a syllable if it is a real one (the final the onset
    led into is not heard); letters collect into a word until any other code. Silence ends a
    pending onset and emits nothing. The tone of a final of a
    non-default speaker may be misheard (``misread_tone``). Unknown codes,
    out-of-range or non-integer values (floats, strings, None), lone finals, invalid pairs and an onset
    not followed by a final are noise and are skipped.
    """
    valid = syllables()
    out: list[str] = []
    pending: str | None = None
    letters: list[str] = []
    for tok in tokens:
        try:
            code = operator.index(tok)
            kind, value = _KIND[code]
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if kind == "letter":
            pending = None
            letters.append(value)  # type: ignore[arg-type]
            continue
        if letters:
            out.append("".join(letters))
            letters = []
        if kind == "silence":
            pending = None
        elif kind == "onset":
            pending = value[0]  # type: ignore[index]  # the initial; the onset's final is not heard
        elif pending is not None:  # a final after an onset
            fin, tone = value  # type: ignore[misc]
            syl = pending + fin
            if syl in valid:
                out.append(f"{syl}{misread_tone(_SPEAKER_OF[code], len(out), syl, tone)}")
            pending = None
    if letters:
        out.append("".join(letters))
    return " ".join(out)


def expected_len(text: str) -> int:
    """Number of codes ``encode(text)`` produces (the length a perfect model emits)."""
    return len(encode(text))
