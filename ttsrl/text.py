"""Text metrics: Mandarin normalisation, pinyin, error rates.

Everything here is a pure function of its arguments. The pieces build on each other:

    normalize(text)          -> canonical text: simplified characters, numbers read out
                                as Chinese words, no punctuation, English lower-cased
    pinyin(text)             -> tone-numbered syllables (tone sandhi applied, neutral = 5)
    error_counts / cer / pinyin_error_rate
                             -> edit-distance error rates over chars or syllables,
                                with BOTH sides normalised the same way (the reference
                                recipe normalised only the reference)

The reward variants and the length guard built on these live in ``ttsrl.reward.rewards``.

Transcripts of the simulated codec (``ttsrl.embedded.codec``) are space-separated toned pinyin
("ni2 hao3 ma5"), so ``normalize`` and ``pinyin`` pass a token that already is a
toned syllable through unchanged: ``pinyin(" ".join(pinyin(t))) == pinyin(t)``.
One consequence: an ASCII token made of a valid pinyin syllable followed by one
digit 1-5 ("a1", "ma5") is read as a syllable, never as a word plus a number.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import Callable, Literal

import cn2an
import jiwer
import zhconv
from pypinyin import Style, lazy_pinyin
from pypinyin.contrib.tone_convert import to_tone3
from pypinyin.pinyin_dict import pinyin_dict

#: typical Mandarin speaking rate (4-5 syllables/s): the reward's expected length and the
#: simulated codec's token rate both derive from it
SYLLABLES_PER_SECOND = 4.5

# ---------------------------------------------------------------------------
# character classes and syllables

_CJK_RANGES = (
    (0x3007, 0x3007),    # 〇
    (0x3040, 0x30FF),    # hiragana, katakana
    (0x3400, 0x4DBF),    # CJK extension A
    (0x4E00, 0x9FFF),    # CJK unified ideographs
    (0xAC00, 0xD7AF),    # hangul syllables
    (0xF900, 0xFAFF),    # CJK compatibility ideographs
    (0x20000, 0x3FFFF),  # CJK extensions B..
)


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


@lru_cache(maxsize=1)
def syllables() -> frozenset[str]:
    """Every toneless pinyin syllable pypinyin can produce ("zhuang", "lv", "n", "ê")."""
    out = set()
    for readings in pinyin_dict.values():
        for marked in readings.split(","):
            out.add(re.sub(r"[1-5]", "", to_tone3(marked, neutral_tone_with_five=True)))
    return frozenset(out)


_TONED_RE = re.compile(r"^([a-zê]+)([1-5])$")


def is_toned_syllable(token: str) -> bool:
    """True for a valid syllable plus tone digit: "ni3", "ma5", "lv4"."""
    m = _TONED_RE.match(token)
    return bool(m) and m.group(1) in syllables()


# ---------------------------------------------------------------------------
# numbers -> Chinese words (small documented rules; cn2an reads cardinals)

_DIGITS = "零一二三四五六七八九"
# "2" before one of these measure words is read 两 (两个, 两点, 两天), elsewhere 二.
_LIANG_BEFORE = "个只位本次件张条天岁种名块辆台双对杯碗口层段首句周倍斤点小分"


def _digits(s: str) -> str:
    """Digit by digit: "0101" -> 零一零一 (1 is read 一, not 幺)."""
    return "".join(_DIGITS[int(d)] for d in s)


def _cardinal(s: str) -> str:
    """An integer as a Chinese number: "1001" -> 一千零一. Over 16 digits: digit by digit."""
    s = s.lstrip("0") or "0"
    if len(s) > 16 or not s.isascii():
        return _digits(s)
    try:
        out = cn2an.an2cn(s, "low")
    except Exception:  # cn2an's own checks: read it digit by digit rather than fail a reward
        return _digits(s)
    # a leading 2 before 千/万/亿 is spoken 两: 2000 -> 两千, 20000 -> 两万
    return "两" + out[1:] if out[:2] in ("二千", "二万", "二亿") else out


def _decimal(int_part: str, frac: str | None) -> str:
    out = _cardinal(int_part)
    return out + "点" + _digits(frac) if frac else out


def _integer(m: re.Match) -> str:
    """Rule for a bare run of digits left after the specific rules below.

    Read digit by digit when it looks like a code or phone number: it starts with 0
    ("010", "007"), or it has 7+ digits and does not end in 000 ("13812345678",
    but "1000000" is 一百万). Otherwise a cardinal, with 2 before a measure word as 两.
    """
    s = m.group(0)
    if (len(s) > 1 and s[0] == "0") or (len(s) >= 7 and not s.endswith("000")):
        return _digits(s)
    after = m.string[m.end():m.end() + 1]
    before = m.string[m.start() - 1:m.start()] if m.start() else ""
    if s == "2" and after and after in _LIANG_BEFORE and before != "第":
        return "两"
    return _cardinal(s)


def _time(m: re.Match) -> str:
    hour, minute = int(m.group(1)), int(m.group(2))
    if hour > 24 or minute > 59:  # not a time: read both numbers, drop the colon
        return _cardinal(m.group(1)) + " " + _cardinal(m.group(2))
    out = ("两" if hour == 2 else _cardinal(m.group(1))) + "点"
    if minute:
        out += ("零" if minute < 10 else "") + _cardinal(str(minute)) + "分"
    return out


_NUMBER_RULES: tuple[tuple[re.Pattern, Callable[[re.Match], str]], ...] = (
    # thousands separators: 1,000,000 -> 1000000
    (re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))"), lambda m: ""),
    # ISO-like dates 2024-03-05, 2024/3/5, 2024.3.5
    (re.compile(r"(?<![0-9])([0-9]{4})[-/.]([0-9]{1,2})[-/.]([0-9]{1,2})(?![0-9])"),
     lambda m: _digits(m.group(1)) + "年" + _cardinal(m.group(2)) + "月"
     + _cardinal(m.group(3)) + "日"),
    # clock times 10:30 -> 十点三十分, 8:05 -> 八点零五分, 9:00 -> 九点
    (re.compile(r"(?<![0-9])([0-9]{1,2})[:：]([0-9]{2})(?![0-9])"), _time),
    # scores with a one-digit second number 3:2 -> 三比二
    (re.compile(r"(?<![0-9])([0-9]+)[:：]([0-9])(?![0-9])"),
     lambda m: _cardinal(m.group(1)) + "比" + _cardinal(m.group(2))),
    # years are read digit by digit: 2024年 -> 二零二四年 (months and days: cardinals)
    (re.compile(r"(?<![0-9])([0-9]{4})(?=年)"), lambda m: _digits(m.group(1))),
    # percentages / per mille: 50% -> 百分之五十, 3.5% -> 百分之三点五
    (re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*%"), lambda m: "百分之" + _decimal(m.group(1), m.group(2))),
    (re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*‰"), lambda m: "千分之" + _decimal(m.group(1), m.group(2))),
    # phone numbers with hyphens (7+ digits): 010-12345678 -> digit by digit
    (re.compile(r"(?<![0-9])[0-9]+(?:-[0-9]+)+(?![0-9])"),
     lambda m: (_digits(m.group(0).replace("-", ""))
                if sum(c.isdigit() for c in m.group(0)) >= 7 else m.group(0))),
    # ranges 3-5, 3~5 -> 三到五
    (re.compile(r"(?<![0-9.])([0-9]{1,4})\s*[-~]\s*([0-9]{1,4})(?![0-9.])"),
     lambda m: _cardinal(m.group(1)) + "到" + _cardinal(m.group(2))),
    # fractions 3/4 -> 四分之三
    (re.compile(r"(?<![0-9])([0-9]+)/([0-9]+)(?![0-9])"),
     lambda m: _cardinal(m.group(2)) + "分之" + _cardinal(m.group(1))),
    # decimals 3.14 -> 三点一四
    (re.compile(r"([0-9]+)\.([0-9]+)"), lambda m: _decimal(m.group(1), m.group(2))),
    # a minus sign not preceded by a letter or digit: -5 -> 负五, "温度-3度" -> 温度负三度
    (re.compile(r"(?<![A-Za-z0-9])-(?=[0-9])"), lambda m: "负"),
    (re.compile(r"[0-9]+"), _integer),
)

# a toned syllable standing as its own ASCII token ("ni3"): protected from the rules
_TONED_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9ê])([A-Za-zê]+)([1-5])(?![A-Za-z0-9])")
_APOSTROPHE_RE = re.compile(r"(?<=[^\W\d_])['’](?=[^\W\d_])")
_CJK_CLASS = "".join(
    f"{chr(lo)}-{chr(hi)}" if lo != hi else chr(lo) for lo, hi in _CJK_RANGES)
_UNIT_RE = re.compile(rf"[{_CJK_CLASS}]|[^\s{_CJK_CLASS}]+")


@lru_cache(maxsize=1)
def _decimal_digits() -> dict[int, str]:
    """Every Unicode decimal digit (category Nd: Arabic-Indic ٣, Devanagari ३, ...) ->
    its ASCII digit. NFKC maps only full-width and mathematical digits."""
    import sys

    out = {}
    for cp in range(128, sys.maxunicode + 1):
        d = unicodedata.decimal(chr(cp), None)
        if d is not None:
            out[cp] = str(d)
    return out


def _numbers_to_words(text: str) -> str:
    for pattern, repl in _NUMBER_RULES:
        text = pattern.sub(repl, text)
    return text


def _is_separator(ch: str) -> bool:
    """Punctuation, symbols, spaces and control characters all separate words."""
    return unicodedata.category(ch)[0] in "PSZC"


def normalize(text: str) -> str:
    """Canonical form of a Mandarin (or mixed) sentence; idempotent.

    1. Unicode NFKC (full-width digits/letters/％ become ASCII), every other decimal
       digit (Arabic-Indic ٣, Devanagari ३, ...) becomes its ASCII digit, traditional ->
       simplified (zhconv). It never raises: what no rule reads passes through.
    2. Numbers become Chinese words (see ``_NUMBER_RULES``): dates, clock times,
       percentages, phone-like strings, fractions, decimals, negatives, cardinals.
       Tokens that already are toned syllables ("ni3") are left alone.
    3. English is lower-cased (casefold); an apostrophe inside a word is dropped
       ("don't" -> "dont").
    4. Punctuation and symbols (CJK and ASCII) are removed; there is no space next to
       a CJK character and exactly one space between two non-CJK words:
       "我用 iPhone 拍照。" -> "我用iphone拍照", "Hello,  World" -> "hello world".
    """
    text = unicodedata.normalize("NFKC", text)
    if not text.isascii():
        text = zhconv.convert(text.translate(_decimal_digits()), "zh-cn")
    pieces, pos = [], 0
    for m in _TONED_TOKEN_RE.finditer(text):
        if m.group(1).lower() in syllables():
            pieces += [_numbers_to_words(text[pos:m.start()]), m.group(0).lower()]
            pos = m.end()
    pieces.append(_numbers_to_words(text[pos:]))
    text = _APOSTROPHE_RE.sub("", " ".join(pieces).casefold())
    text = "".join(" " if _is_separator(ch) else ch for ch in text)
    out: list[str] = []
    for unit in _UNIT_RE.findall(text):
        if out and not is_cjk(unit[0]) and not is_cjk(out[-1][-1]):
            out.append(" ")
        out.append(unit)
    return "".join(out)


# ---------------------------------------------------------------------------
# pinyin

def _strip_tone(token: str) -> str:
    return token[:-1] if is_toned_syllable(token) else token


def pinyin(text: str, tones: bool = True) -> list[str]:
    """Tone-numbered pinyin of ``normalize(text)``, one token per syllable.

    Chinese: pypinyin ``Style.TONE3`` with tone sandhi, neutral tone 5 ("你好吗" ->
    ["ni2", "hao3", "ma5"]); "ü" is written "v" ("lv4"). An English word stays one
    lower-case token; a token that already is a toned syllable passes through
    unchanged (no sandhi is re-applied), so the function is idempotent on its own
    joined output. ``tones=False`` drops the tone digit of every syllable.
    """
    out: list[str] = []
    for run in re.findall(rf"[{_CJK_CLASS}]+|[^\s{_CJK_CLASS}]+", normalize(text)):
        if is_cjk(run[0]):
            out += lazy_pinyin(run, style=Style.TONE3, neutral_tone_with_five=True,
                               tone_sandhi=True)
        else:
            out.append(run)
    return out if tones else [_strip_tone(t) for t in out]


def is_pinyin_transcript(hyp: str) -> bool:
    """True when ``hyp`` is a space-separated toned-pinyin transcript (simulated ASR).

    That is: no CJK characters, every token a toned syllable or a plain lower-case
    ASCII word, and at least one toned syllable ("wo3 yong4 iphone pai1 zhao4").
    """
    tokens = hyp.casefold().split()
    if not tokens or any(is_cjk(ch) for ch in hyp):
        return False
    toned = [is_toned_syllable(t) for t in tokens]
    return any(toned) and all(ok or re.fullmatch(r"[a-z]+", t) for ok, t in zip(toned, tokens))


# ---------------------------------------------------------------------------
# error rates

Unit = Literal["char", "pinyin"]


def error_counts(ref: str, hyp: str, unit: Unit = "char", *, tones: bool = True) -> tuple[int, int]:
    """(edit errors, reference length) for corpus-level, micro-averaged error rates.

    unit="pinyin": Levenshtein distance over ``pinyin()`` syllables (an English word
    is one token). unit="char": over the characters of ``normalize()``d text; a space
    between two English words counts as a character, and an English word counts
    per letter. When ``hyp`` is a toned-pinyin transcript (``is_pinyin_transcript``)
    characters cannot be compared, so "char" falls back to syllables (one Chinese
    character is one syllable). An empty reference gives (len(hyp units), 0).
    """
    if unit == "char" and is_pinyin_transcript(hyp):
        unit = "pinyin"
    if unit == "pinyin":
        r, h = " ".join(pinyin(ref, tones)), " ".join(pinyin(hyp, tones))
        if not r:
            return len(h.split()), 0
        o = jiwer.process_words(r, h)
    elif unit == "char":
        r, h = normalize(ref), normalize(hyp)
        if not r:
            return len(h), 0
        o = jiwer.process_characters(r, h)
    else:
        raise ValueError(f"unit must be 'char' or 'pinyin', got {unit!r}")
    return o.substitutions + o.deletions + o.insertions, o.substitutions + o.deletions + o.hits


def _rate(errors: int, ref_len: int) -> float:
    if ref_len == 0:
        return 0.0 if errors == 0 else 1.0
    return errors / ref_len


def pinyin_error_rate(ref: str, hyp: str, tones: bool = True) -> float:
    """WER over pinyin syllables, both sides normalised. Can exceed 1 (insertions).

    Empty reference: 0.0 if the hypothesis is empty too, else 1.0.
    """
    return _rate(*error_counts(ref, hyp, "pinyin", tones=tones))


def cer(ref: str, hyp: str) -> float:
    """Character error rate on normalised text (see ``error_counts`` unit="char").

    Falls back to the syllable error rate for a toned-pinyin transcript. Can exceed 1.
    """
    return _rate(*error_counts(ref, hyp, "char"))


# ---------------------------------------------------------------------------
# can the reward read a text?

@lru_cache(maxsize=1)
def _non_ascii_numbers() -> frozenset[str]:
    """Every non-ASCII character of Unicode category N (Nd, Nl, No)."""
    import sys

    return frozenset(chr(cp) for cp in range(128, sys.maxunicode + 1) if unicodedata.category(chr(cp))[0] == "N")


_ALNUM_RE = re.compile(r"[^\W_]")


def unreadable(text: str) -> str | None:
    """Why ``normalize`` cannot read ``text`` out (None when it can).

    ``normalize`` never raises; what it cannot read it passes through. For a reference
    text that matters: a number left as a symbol ("〡", U+3021) is never spoken the
    same way twice, and a text with nothing left to speak has no error rate. Only a
    text with a letter or digit, and whose non-ASCII numbers all normalise to words,
    is readable (checked without normalising when it has no non-ASCII number)."""
    if not _ALNUM_RE.search(text):
        return "nothing to speak (no letter or digit)"
    if text.isascii() or _non_ascii_numbers().isdisjoint(text):
        return None
    norm = normalize(text)
    for ch in norm:
        if unicodedata.category(ch)[0] == "N":
            name = unicodedata.name(ch, "unnamed")
            return (f"{ch!r} (U+{ord(ch):04X} {name}) is a number the text normaliser cannot read out; "
                    "write it in words or ASCII digits")
    if not _ALNUM_RE.search(norm):
        return "nothing to speak after normalisation (no letter or digit)"
    return None
