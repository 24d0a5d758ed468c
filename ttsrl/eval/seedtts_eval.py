"""The Seed-TTS eval convention for per-utterance CER / WER (what TTS papers report).

Read from BytedanceSpeech/seed-tts-eval at commit 752f4297f090c46bb1a55a1f7439e5944ddefe8d
(``run_wer.py``: ``process_one``; ``average_wer.py``; both files last changed in 95003fe4).
Written here from that reading, not copied. Per utterance:

1. zh only: the *transcript* (not the reference) is converted to simplified Chinese
   with zhconv (``zh-cn``).
2. Both sides: every character of zhon's Chinese punctuation (``zhon.hanzi.punctuation``)
   and of ASCII ``string.punctuation`` is deleted, except the ASCII apostrophe ``'``.
   Nothing else is normalised: digits stay digits, no NFKC, no number reading.
3. zh: the text is split into characters (a space is no token; an English word in a
   Chinese sentence counts letter by letter, case-sensitively). en: lower-cased, split
   into words on spaces ("well-known" -> "wellknown", one word).
4. jiwer's word error rate of that utterance: (S + D + I) / reference tokens (can
   exceed 1).

The set's figure is the MEAN of the per-utterance rates, and ``average_wer.py`` also
counts utterances whose rate is above 0.5 (we report their share).

Where we differ, on purpose: an utterance with no output counts as rate 1.0 (upstream's
run_wer.py skips a missing wav, so it never counts); an empty reference scores 0.0 when
the transcript is empty too, else 1.0 (upstream's jiwer version raised). The simulated ASR
of the embedded world writes toned pinyin, which cannot be split into characters: for
such transcripts the per-utterance rate is over toned syllables (``ttsrl.text``), one
Chinese character being one syllable, and the unit says so. A pinyin transcript has no
digits, so on that path both sides are normalised first (numbers read out): step 2's "digits
stay digits" holds on the character path only (docs/evaluation.md).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import jiwer
import zhconv
from zhon.hanzi import punctuation as _ZHON_PUNCTUATION

from ttsrl.text import error_counts, is_cjk, is_pinyin_transcript

Lang = Literal["zh", "en"]
LANGS: tuple[str, ...] = ("zh", "en")
CONVENTION = "seed-tts-eval"
UPSTREAM_COMMIT = "752f4297f090c46bb1a55a1f7439e5944ddefe8d"
ABOVE = 0.5  # average_wer.py's threshold (strictly above)

PUNCTUATION = frozenset(_ZHON_PUNCTUATION + string.punctuation) - {"'"}


@dataclass(frozen=True)
class UttScore:
    errors: int
    ref_len: int
    unit: str  # "char", "word" or "syllable" (simulated ASR)

    @property
    def rate(self) -> float:
        if self.ref_len == 0:
            return 0.0 if self.errors == 0 else 1.0
        return self.errors / self.ref_len


def detect_lang(texts: Iterable[str]) -> Lang:
    """zh when at least half of the texts hold a CJK character, else en."""
    texts = list(texts)
    zh = sum(1 for t in texts if any(is_cjk(c) for c in t))
    return "zh" if texts and 2 * zh >= len(texts) else "en"


def _prepared(text: str, lang: str, *, transcript: bool) -> str:
    """The string run_wer.py hands to jiwer for one side."""
    if lang == "zh" and transcript:
        text = zhconv.convert(text, "zh-cn")
    text = "".join(c for c in text if c not in PUNCTUATION)
    text = text.replace("  ", " ")  # as upstream (once); jiwer collapses the rest anyway
    if lang == "zh":
        return " ".join(text)  # one token per character; spaces vanish in jiwer's split
    if lang == "en":
        return text.lower()
    raise ValueError(f"language must be one of {LANGS}, got {lang!r}")


def score_utterance(ref: str, hyp: str, lang: str) -> UttScore:
    """(errors, reference tokens, unit) of one utterance under the Seed-TTS convention."""
    if lang == "zh" and is_pinyin_transcript(hyp):
        e, n = error_counts(ref, hyp, "pinyin")
        return UttScore(e, n, "syllable")
    unit = "char" if lang == "zh" else "word"
    # jiwer's own default word transform splits both sides (an empty side is all deletions
    # or all insertions)
    o = jiwer.process_words(_prepared(ref, lang, transcript=False), _prepared(hyp, lang, transcript=True))
    return UttScore(o.substitutions + o.deletions + o.insertions, o.substitutions + o.deletions + o.hits, unit)


def utt_mean(rates: Sequence[float]) -> float:
    """The set's figure: mean of per-utterance rates (0.0 for no utterances)."""
    return sum(rates) / len(rates) if rates else 0.0


def share_above(rates: Sequence[float], threshold: float = ABOVE) -> float:
    """Share of utterances whose rate is above ``threshold`` (average_wer.py's count / n)."""
    return sum(1 for x in rates if x > threshold) / len(rates) if rates else 0.0
