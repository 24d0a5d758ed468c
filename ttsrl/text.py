"""Text side of the reward: Mandarin normalisation, pinyin, error rates, rewards.

Everything here is a pure function of its arguments. The pieces build on each other:

    normalize(text)          -> canonical text: simplified characters, numbers read out
                                as Chinese words, no punctuation, English lower-cased
    pinyin(text)             -> tone-numbered syllables (tone sandhi applied, neutral = 5)
    error_counts / cer / pinyin_error_rate
                             -> edit-distance error rates over chars or syllables,
                                with BOTH sides normalised the same way (the reference
                                recipe normalised only the reference)
    compute_reward(name, ...)-> a RewardResult for one of the variants in REWARDS

Transcripts of the simulated codec (``ttsrl.sim``) are space-separated toned pinyin
("ni2 hao3 ma5"), so ``normalize`` and ``pinyin`` pass a token that already is a
toned syllable through unchanged: ``pinyin(" ".join(pinyin(t))) == pinyin(t)``.
One consequence: an ASCII token made of a valid pinyin syllable followed by one
digit 1-5 ("a1", "ma5") is read as a syllable, never as a word plus a number.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Literal

import cn2an
import jiwer
import zhconv
from pypinyin import Style, lazy_pinyin
from pypinyin.contrib.tone_convert import to_tone3
from pypinyin.pinyin_dict import pinyin_dict

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


def _is_cjk(ch: str) -> bool:
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
    if len(s) > 16:
        return _digits(s)
    out = cn2an.an2cn(s, "low")
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
    (re.compile(r"(?<=\d),(?=\d{3}(?!\d))"), lambda m: ""),
    # ISO-like dates 2024-03-05, 2024/3/5, 2024.3.5
    (re.compile(r"(?<!\d)(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})(?!\d)"),
     lambda m: _digits(m.group(1)) + "年" + _cardinal(m.group(2)) + "月"
     + _cardinal(m.group(3)) + "日"),
    # clock times 10:30 -> 十点三十分, 8:05 -> 八点零五分, 9:00 -> 九点
    (re.compile(r"(?<!\d)(\d{1,2})[:：](\d{2})(?!\d)"), _time),
    # scores with a one-digit second number 3:2 -> 三比二
    (re.compile(r"(?<!\d)(\d+)[:：](\d)(?!\d)"),
     lambda m: _cardinal(m.group(1)) + "比" + _cardinal(m.group(2))),
    # years are read digit by digit: 2024年 -> 二零二四年 (months and days: cardinals)
    (re.compile(r"(?<!\d)(\d{4})(?=年)"), lambda m: _digits(m.group(1))),
    # percentages / per mille: 50% -> 百分之五十, 3.5% -> 百分之三点五
    (re.compile(r"(\d+)(?:\.(\d+))?\s*%"), lambda m: "百分之" + _decimal(m.group(1), m.group(2))),
    (re.compile(r"(\d+)(?:\.(\d+))?\s*‰"), lambda m: "千分之" + _decimal(m.group(1), m.group(2))),
    # phone numbers with hyphens (7+ digits): 010-12345678 -> digit by digit
    (re.compile(r"(?<!\d)\d+(?:-\d+)+(?!\d)"),
     lambda m: (_digits(m.group(0).replace("-", ""))
                if sum(c.isdigit() for c in m.group(0)) >= 7 else m.group(0))),
    # ranges 3-5, 3~5 -> 三到五
    (re.compile(r"(?<![\d.])(\d{1,4})\s*[-~]\s*(\d{1,4})(?![\d.])"),
     lambda m: _cardinal(m.group(1)) + "到" + _cardinal(m.group(2))),
    # fractions 3/4 -> 四分之三
    (re.compile(r"(?<!\d)(\d+)/(\d+)(?!\d)"),
     lambda m: _cardinal(m.group(2)) + "分之" + _cardinal(m.group(1))),
    # decimals 3.14 -> 三点一四
    (re.compile(r"(\d+)\.(\d+)"), lambda m: _decimal(m.group(1), m.group(2))),
    # a minus sign not preceded by a letter or digit: -5 -> 负五, "温度-3度" -> 温度负三度
    (re.compile(r"(?<![A-Za-z0-9])-(?=\d)"), lambda m: "负"),
    (re.compile(r"\d+"), _integer),
)

# a toned syllable standing as its own ASCII token ("ni3"): protected from the rules
_TONED_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9ê])([A-Za-zê]+)([1-5])(?![A-Za-z0-9])")
_APOSTROPHE_RE = re.compile(r"(?<=[^\W\d_])['’](?=[^\W\d_])")
_CJK_CLASS = "".join(
    f"{chr(lo)}-{chr(hi)}" if lo != hi else chr(lo) for lo, hi in _CJK_RANGES)
_UNIT_RE = re.compile(rf"[{_CJK_CLASS}]|[^\s{_CJK_CLASS}]+")


def _numbers_to_words(text: str) -> str:
    for pattern, repl in _NUMBER_RULES:
        text = pattern.sub(repl, text)
    return text


def _is_separator(ch: str) -> bool:
    """Punctuation, symbols, spaces and control characters all separate words."""
    return unicodedata.category(ch)[0] in "PSZC"


def normalize(text: str) -> str:
    """Canonical form of a Mandarin (or mixed) sentence; idempotent.

    1. Unicode NFKC (full-width digits/letters/％ become ASCII), traditional ->
       simplified (zhconv).
    2. Numbers become Chinese words (see ``_NUMBER_RULES``): dates, clock times,
       percentages, phone-like strings, fractions, decimals, negatives, cardinals.
       Tokens that already are toned syllables ("ni3") are left alone.
    3. English is lower-cased (casefold); an apostrophe inside a word is dropped
       ("don't" -> "dont").
    4. Punctuation and symbols (CJK and ASCII) are removed; there is no space next to
       a CJK character and exactly one space between two non-CJK words:
       "我用 iPhone 拍照。" -> "我用iphone拍照", "Hello,  World" -> "hello world".
    """
    text = zhconv.convert(unicodedata.normalize("NFKC", text), "zh-cn")
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
        if out and not _is_cjk(unit[0]) and not _is_cjk(out[-1][-1]):
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
        if _is_cjk(run[0]):
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
    if not tokens or any(_is_cjk(ch) for ch in hyp):
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
# length plausibility

SYLLABLES_PER_SECOND = 4.5   # typical Mandarin speaking rate (4-5 syllables/s)
COSYVOICE2_TOKEN_RATE = 25.0  # speech tokens per second of CosyVoice2's tokenizer
LENGTH_BAND = (0.5, 2.0)     # plausible actual/expected token-count ratios


def _syllable_count(token: str) -> int:
    if is_toned_syllable(token):
        return 1
    if _is_cjk(token[0]):  # characters pypinyin has no reading for (kana, rare hanzi)
        return len(token)
    return max(1, len(re.findall(r"[aeiouy]+", token)))  # English: vowel groups


def expected_tokens(text: str, token_rate: float = COSYVOICE2_TOKEN_RATE) -> float:
    """Expected number of speech tokens for ``text`` at ``token_rate`` tokens/s.

    syllables * token_rate / SYLLABLES_PER_SECOND; a Chinese syllable counts 1, an
    English word its vowel groups (at least 1). For CosyVoice2: ~5.6 tokens/syllable.
    """
    return sum(_syllable_count(t) for t in pinyin(text)) * token_rate / SYLLABLES_PER_SECOND


def length_factor(n_tokens: int, expected: float,
                  band: tuple[float, float] = LENGTH_BAND) -> tuple[float, float | None, bool]:
    """(factor, ratio, ok) of the length guard.

    ratio = n_tokens / expected. Inside ``band`` the factor is 1; outside it falls off
    continuously with the distance to the band: factor = min(1, ratio/lo, hi/ratio) ** 2,
    so 3x too many tokens (ratio 3, band [0.5, 2]) gives (2/3)^2 = 0.44 and 3x too few
    gives the same. No expectation (empty text) disables the guard.
    """
    if expected <= 0:
        return 1.0, None, True
    lo, hi = band
    ratio = max(0, n_tokens) / expected
    factor = min(1.0, ratio / lo, hi / ratio if ratio > 0 else 1.0) ** 2
    return factor, ratio, lo <= ratio <= hi


# ---------------------------------------------------------------------------
# rewards

@dataclass(frozen=True)
class RewardResult:
    reward: float              # final reward in [0, 1], length guard applied
    error_rate: float          # the error rate the variant used (c)
    length_ok: bool            # ratio inside LENGTH_BAND (True when not checked)
    raw_reward: float          # reward before the length guard
    length_factor: float = 1.0
    length_ratio: float | None = None
    confidence: float | None = None  # ASR confidence term (cer_nll only)


def tanh_reward(c: float) -> float:
    """clip(1 - tanh(3 c), 0, 1): c=0 -> 1, c=0.1 -> 0.709, c=0.2 -> 0.463."""
    return min(1.0, max(0.0, 1.0 - math.tanh(3.0 * c)))


def _tanh_variant(ref: str, hyp: str, asr_logprob: float | None):
    c = pinyin_error_rate(ref, hyp, tones=True)
    return tanh_reward(c), c, None


_REF_TN_LOCK = __import__("threading").Lock()


@lru_cache(maxsize=1)
def _reference_normalizer():
    """The reference recipe's text normaliser (CosyVoice examples/grpo/cosyvoice2/
    token2wav_asr_server.py at a224be61): WeTextProcessing's ZhNormalizer with
    remove_erhua=False, remove_interjections=False, remove_puncts=True. Its grammar is
    compiled once with these options into TTSRL_CACHE_DIR (the wheel's prebuilt one keeps
    punctuation), which takes minutes the first time."""
    import os
    from pathlib import Path

    try:
        from tn.chinese.normalizer import Normalizer
    except ImportError as e:
        raise ImportError("reward 'tanh_reference' needs WeTextProcessing (pip install wetextprocessing==1.2.0)") from e
    cache = Path(os.environ.get("TTSRL_CACHE_DIR") or Path.home() / ".cache" / "ttsrl") / "wetext-reference"
    cache.mkdir(parents=True, exist_ok=True)
    return Normalizer(cache_dir=str(cache), remove_erhua=False, remove_interjections=False,
                      remove_puncts=True, overwrite_cache=False)


def reference_pinyin_wer(ref: str, hyp: str) -> float:
    """The reference recipe's c: jiwer WER over lazy_pinyin(TONE3, sandhi, neutral 5) of
    WeTextProcessing-normalised, lower-cased text (an empty reference, on which the
    reference crashes, gives 0.0 for an empty hypothesis, else 1.0)."""
    with _REF_TN_LOCK:
        tn = _reference_normalizer()
        g, h = tn.normalize(ref).lower(), tn.normalize(hyp).lower()
    gp = " ".join(lazy_pinyin(g, style=Style.TONE3, tone_sandhi=True, neutral_tone_with_five=True)).strip()
    hp = " ".join(lazy_pinyin(h, style=Style.TONE3, tone_sandhi=True, neutral_tone_with_five=True)).strip()
    if not gp:
        return 0.0 if not hp else 1.0
    if not hp:
        return 1.0
    return float(jiwer.wer(gp, hp))


def _tanh_reference_variant(ref: str, hyp: str, asr_logprob: float | None):
    c = reference_pinyin_wer(ref, hyp)
    return tanh_reward(c), c, None


def _toneless_variant(ref: str, hyp: str, asr_logprob: float | None):
    c = pinyin_error_rate(ref, hyp, tones=False)
    return tanh_reward(c), c, None


def _cer_nll_variant(ref: str, hyp: str, asr_logprob: float | None):
    """Composite CER + ASR-likelihood reward after Liu et al., "Group Relative Policy
    Optimization for Text-to-Speech with Large Language Models", arXiv:2509.18798.

    Our exact form (the paper's constants could not be checked offline):
        r_cer  = clip(1 - CER, 0, 1)                 (CER from ``cer``)
        r_conf = exp(asr_logprob)                    asr_logprob = mean log-likelihood
                                                     per token the ASR assigns to the
                                                     reference text given the audio
                                                     (= exp(-NLL), in (0, 1])
        reward = 2 r_cer r_conf / (r_cer + r_conf)   (harmonic mean, equal weights;
                                                     0 when either term is 0)
    The harmonic mean stays low unless BOTH the transcript and the ASR's confidence
    in the reference are good.
    """
    if asr_logprob is None:
        raise ValueError("reward 'cer_nll' needs asr_logprob (mean log-likelihood the ASR "
                         "assigns to the reference text given the audio); got None")
    if not math.isfinite(asr_logprob):
        raise ValueError(f"asr_logprob must be finite, got {asr_logprob!r}")
    c = cer(ref, hyp)
    r_cer = min(1.0, max(0.0, 1.0 - c))
    r_conf = min(1.0, math.exp(min(0.0, asr_logprob)))
    reward = 0.0 if r_cer + r_conf == 0 else 2 * r_cer * r_conf / (r_cer + r_conf)
    return reward, c, r_conf


RewardFn = Callable[[str, str, "float | None"], "tuple[float, float, float | None]"]

#: name -> fn(ref, hyp, asr_logprob) -> (raw reward, error rate, confidence or None)
REWARDS: dict[str, RewardFn] = {
    "tanh": _tanh_variant,
    "toneless": _toneless_variant,
    "tanh_reference": _tanh_reference_variant,  # the reference's own normalisation (WeTextProcessing)
    "cer_nll": _cer_nll_variant,
}


def compute_reward(name: str, ref: str, hyp: str, *, asr_logprob: float | None = None,
                   n_tokens: int | None = None,
                   token_rate: float = COSYVOICE2_TOKEN_RATE) -> RewardResult:
    """Reward of transcript ``hyp`` for reference ``ref`` under variant ``name``.

    When ``n_tokens`` (speech tokens generated) is given, the length guard scales the
    reward by ``length_factor(n_tokens, expected_tokens(ref, token_rate))``.
    """
    try:
        fn = REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}") from None
    raw, err, conf = fn(ref, hyp, asr_logprob)
    factor, ratio, ok = 1.0, None, True
    if n_tokens is not None:
        factor, ratio, ok = length_factor(n_tokens, expected_tokens(ref, token_rate))
    return RewardResult(reward=raw * factor, error_rate=err, length_ok=ok, raw_reward=raw,
                        length_factor=factor, length_ratio=ratio, confidence=conf)
