"""A simulated speech codec: the embedded CPU preset's "token2wav + ASR".

No neural codec runs here, so the embedded preset replaces speech with a fixed,
invertible code: a sentence becomes its toned pinyin (``ttsrl.text.pinyin``, the
same normalisation the reward uses) and every unit becomes a short pattern of
speech codes in 0..SPEECH_TOKEN_SIZE-1:

    Chinese syllable   [initial code, final+tone code]     "hao3" -> [I(h), F(ao, 3)]
                        (syllables without an initial use the "zero initial" code)
    English word       one code per letter a-z, then WORD_END   "ok" -> [L(o), L(k), WORD_END]
    punctuation        PAUSE between the punctuation-delimited phrases of the text

A tiny LM must learn reading (characters -> syllables, polyphones, tone sandhi,
numbers read out) and the code book; the reward is then honest: ``decode`` turns
ANY token stream into a toned-pinyin transcript the reward scores against the text.

The code book uses 249 of the 6561 codes, spread over the range by a fixed
permutation (logical index k -> (k * _STRIDE + _OFFSET) mod SPEECH_TOKEN_SIZE), so it
is the same in every process and Python version (no ``hash()``, no RNG).
"""

from __future__ import annotations

import operator
import re
from string import ascii_lowercase
from typing import Iterable

from ttsrl.model.vocab import SPEECH_TOKEN_SIZE
from ttsrl.text import SYLLABLES_PER_SECOND, is_toned_syllable, pinyin, syllables

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


def _code(k: int) -> int:
    return (k * _STRIDE + _OFFSET) % SPEECH_TOKEN_SIZE


# logical layout: silences, initials, finals x tones, letters
_SIL0 = 0
_INI0 = _SIL0 + N_SILENCE
_FIN0 = _INI0 + len(INITIALS)
_LET0 = _FIN0 + len(FINALS) * len(TONES)
NUM_CODES = _LET0 + len(LETTERS)

SILENCE_CODES: tuple[int, ...] = tuple(_code(_SIL0 + i) for i in range(N_SILENCE))
PAUSE, WORD_END = SILENCE_CODES[0], SILENCE_CODES[1]  # the other two are never emitted
INITIAL_CODES = {ini: _code(_INI0 + i) for i, ini in enumerate(INITIALS)}
FINAL_CODES = {(fin, tone): _code(_FIN0 + i * len(TONES) + j)
               for i, fin in enumerate(FINALS) for j, tone in enumerate(TONES)}
LETTER_CODES = {ch: _code(_LET0 + i) for i, ch in enumerate(LETTERS)}
USED_CODES = frozenset(_code(k) for k in range(NUM_CODES))
assert len(USED_CODES) == NUM_CODES <= SPEECH_TOKEN_SIZE

# code -> (kind, value) for the decoder
_KIND: dict[int, tuple[str, object]] = {c: ("silence", None) for c in SILENCE_CODES}
_KIND.update({c: ("initial", ini) for ini, c in INITIAL_CODES.items()})
_KIND.update({c: ("final", ft) for ft, c in FINAL_CODES.items()})
_KIND.update({c: ("letter", ch) for ch, c in LETTER_CODES.items()})

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


def _unit_codes(token: str) -> list[int]:
    """Codes of one pinyin token; characters outside the code book are skipped."""
    if is_toned_syllable(token):
        ini, fin = split_syllable(token[:-1])
        return [INITIAL_CODES[ini], FINAL_CODES[(fin, int(token[-1]))]]
    letters = [LETTER_CODES[ch] for ch in token if ch in LETTER_CODES]
    return letters + [WORD_END] if letters else []


def encode(text: str) -> list[int]:
    """Speech codes of ``text``: syllable and word patterns, PAUSE at punctuation.

    Pauses go between punctuation-delimited phrases when the phrases' syllable counts
    add up to the whole sentence's (they always do unless a number straddles the
    punctuation); otherwise the sentence is encoded without pauses. Tokens with no
    code (kana, letters outside a-z) are skipped.
    """
    units = pinyin(text)
    counts = [len(pinyin(phrase)) for phrase in _PAUSE_RE.split(text)]
    counts = [n for n in counts if n]
    if sum(counts) != len(units):
        counts = [len(units)]
    codes: list[int] = []
    pos = 0
    for i, n in enumerate(counts):
        if i:
            codes.append(PAUSE)
        for token in units[pos:pos + n]:
            codes += _unit_codes(token)
        pos += n
    return codes


def decode(tokens: Iterable[int]) -> str:
    """Space-separated toned-pinyin transcript of ANY token stream; never raises.

    Greedy left to right: an initial code waits for a final+tone code and the pair
    becomes a syllable if it is a real one; letters collect into a word until any
    other code. Silence ends a pending initial and emits nothing. Unknown codes,
    out-of-range or non-integer values (floats, strings, None), lone finals, invalid pairs and an initial
    not followed by a final are noise and are skipped.
    """
    valid = syllables()
    out: list[str] = []
    pending: str | None = None
    letters: list[str] = []
    for tok in tokens:
        try:
            kind, value = _KIND[operator.index(tok)]
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
        elif kind == "initial":
            pending = value  # type: ignore[assignment]
        elif pending is not None:  # a final after an initial
            fin, tone = value  # type: ignore[misc]
            syl = pending + fin
            if syl in valid:
                out.append(f"{syl}{tone}")
            pending = None
    if letters:
        out.append("".join(letters))
    return " ".join(out)


def expected_len(text: str) -> int:
    """Number of codes ``encode(text)`` produces (the length a perfect model emits)."""
    return len(encode(text))
