"""Reward variants and the length guard, built on the text metrics of ``ttsrl.text``.

    expected_tokens / length_factor -> the length guard (implausibly long or short
                                       speech scales the reward down)
    length_ratio                    -> generated / expected tokens (stage 4 reports its mean)
    compute_reward(name, ...)       -> a RewardResult for one of the variants in REWARDS
                                       (a Reward each: its function and what it needs)
    length_term                     -> the length/finish term (0 for a rollout that never ended)
    WEIGHTS / sim_weight_of         -> the named weightings of the combined reward
    naturalness_term                -> DNSMOS OVRL on the reward's 0..1 scale (the MOS term)

The reward terms, per rollout, each reported on its own (the server's
CER_REWARDS, SIMS, LENGTH_REWARDS outputs; ``compute_score``'s keys ``cer``, ``sim``, ``length``):

    cer     r = the variant's error-rate reward (``RewardResult.raw_reward``), in [0, 1], no length guard
    sim     s = speaker similarity to the prompt (campplus cosine, in [-1, 1]; measured by the backend)
    length  l = 0 for a rollout that hit the response limit without end of speech (unfinished);
                0 for an empty one; else the length guard's factor min(1, ratio/0.5, 2/ratio)^2
                (1 inside the band [0.5, 2] of generated / expected codes)
    mos     q = naturalness_term(DNSMOS OVRL) = (OVRL - 1) / 4 clipped to [0, 1] (measured by the
                server only with a MOS weight; it reports OVRL itself as MOS_OVRLS, ``compute_score``'s ``mos``)

and the combined reward the run trains on (``score``, the server's REWARDS), with SIM weight w and
MOS weight m (a term not measured, s or q, adds nothing):

    score = l * r + w * s + m * q   for a finished rollout (today's reward: the guarded error-rate reward + w SIM)
    score = 0                       for an unfinished one (Magpie-TTS: zero reward for an unfinished output)

With the length guard off (``--no-length-guard``: the reference recipe exactly) the score is
r + w s + m q whatever the length or finish (the length term is still reported). Named weightings (``WEIGHTS``):
``cer`` (w = 0, the default: the CosyVoice2 reference recipe's CER-only reward) and ``glm_tts``
(w = 0.1: GLM-TTS's CER weight 1, SIM weight 0.1). ``--algorithm gdpo`` trains on the three terms
instead (each normalised in its group, then summed), not on the score.

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import jiwer
from pypinyin import Style, lazy_pinyin

from ttsrl import knobs
from ttsrl.text import SYLLABLES_PER_SECOND, cer, is_cjk, is_toned_syllable, pinyin, pinyin_error_rate

# ---------------------------------------------------------------------------
# length plausibility

LENGTH_BAND = (0.5, 2.0)     # plausible actual/expected token-count ratios
UNFINISHED_LENGTH_TERM = 0.0  # the length term (and the score) of a rollout that never ended


def _syllable_count(token: str) -> int:
    if is_toned_syllable(token):
        return 1
    if is_cjk(token[0]):  # characters pypinyin has no reading for (kana, rare hanzi)
        return len(token)
    return max(1, len(re.findall(r"[aeiouy]+", token)))  # English: vowel groups


def expected_tokens(text: str, token_rate: float) -> float:
    """Expected number of speech tokens for ``text`` at ``token_rate`` tokens/s.

    syllables * token_rate / SYLLABLES_PER_SECOND; a Chinese syllable counts 1, an
    English word its vowel groups (at least 1). For CosyVoice2: ~5.6 tokens/syllable.
    """
    return sum(_syllable_count(t) for t in pinyin(text)) * token_rate / SYLLABLES_PER_SECOND


def length_ratio(n_tokens: int, text: str, token_rate: float) -> float | None:
    """Speech tokens generated / tokens expected for ``text`` (``expected_tokens``): about 1
    for speech at a normal rate, above 1 slow or drawn out, below 1 fast or clipped. None
    when the text has no expected length (empty). The ratio the length guard judges."""
    return length_factor(n_tokens, expected_tokens(text, token_rate))[1]


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


def length_term(n_tokens: int, expected: float, finished: bool | None = None,
                band: tuple[float, float] = LENGTH_BAND) -> float:
    """The length/finish term of a rollout of ``n_tokens`` speech codes for a text expecting
    ``expected`` of them: ``UNFINISHED_LENGTH_TERM`` (0) when it hit the response limit without
    end of speech (``finished`` False); 0 when empty (nothing was said); otherwise the length
    guard's factor (:func:`length_factor`: 1 inside ``band``, falling off outside it; 1 for a
    text with no expected length). ``finished`` None: not known (an old client), judged by
    length only."""
    if finished is False:
        return UNFINISHED_LENGTH_TERM
    if n_tokens <= 0:
        return 0.0
    return length_factor(n_tokens, expected, band)[0]


@dataclass(frozen=True)
class Weighting:
    """A named weighting of the combined reward: the SIM weight w in l * r + w * s (the CER
    term's weight is 1 in every one), and where it comes from."""
    sim_weight: float
    source: str


#: name -> weighting; the reward server's --weights and train_grpo.py's --reward-weights choices
WEIGHTS: dict[str, Weighting] = {
    "cer": Weighting(0.0, "the error-rate reward alone (the CosyVoice2 reference GRPO recipe; ttsrl's default)"),
    "glm_tts": Weighting(0.1, "CER 1 + SIM 0.1 (GLM-TTS, Zhipu AI 2025: its multi-reward GRPO weighs CER 1 and "
                              "speaker similarity 0.1)"),
}


def check_weight(name: str, weight: float | None) -> None:
    """ValueError naming the option ``name`` unless ``weight`` is None (not given) or a finite number
    >= 0 (a negative weight would reward the opposite of its term, NaN would poison every reward)."""
    if weight is not None and not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {weight}")


def sim_weight_of(weights: str | None, sim_weight: float | None) -> float | None:
    """The SIM weight a named weighting and/or an explicit weight ask for (None: neither given).
    Both given and different: ValueError naming both; an unknown name: ValueError naming the choices."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"unknown reward weights {weights!r}; choose one of {sorted(WEIGHTS)}")
    named = WEIGHTS[weights].sim_weight if weights is not None else None
    check_weight("sim_weight", sim_weight)
    if named is not None and sim_weight is not None and sim_weight != named:
        raise ValueError(f"reward weights {weights!r} mean SIM weight {named:g}, but SIM weight {sim_weight:g} "
                         "is also given: give one of them")
    return named if named is not None else sim_weight


def weights_help() -> str:
    return "; ".join(f"{name}: SIM weight {w.sim_weight:g}, {w.source}" for name, w in WEIGHTS.items())


def naturalness_term(ovrl: float) -> float:
    """The MOS term q of a DNSMOS P.835 OVRL score: (OVRL - 1) / 4, clipped to [0, 1].

    DNSMOS predicts a 1..5 opinion score while the CER term lives in [0, 1] and SIM is at most 1:
    on the raw scale a MOS weight would mean about four times what the same SIM weight means, and
    DNSMOS's floor of 1 would add a constant to every reward. Mapped onto 0..1, a weight m moves a
    reward by at most m, as SIM's weight does. The clip: DNSMOS's output polynomial can stray a
    little past 1 or 5, and the reward must stay inside the range the server advertises."""
    return min(1.0, max(0.0, (ovrl - 1.0) / 4.0))


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


_REF_TN_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def _reference_normalizer():
    """The reference recipe's text normaliser (CosyVoice examples/grpo/cosyvoice2/
    token2wav_asr_server.py at a224be61): WeTextProcessing's ZhNormalizer with
    remove_erhua=False, remove_interjections=False, remove_puncts=True. Its grammar is
    compiled once with these options into TTSRL_CACHE_DIR (the wheel's prebuilt one keeps
    punctuation), which takes minutes the first time."""
    try:
        from tn.chinese.normalizer import Normalizer
    except ImportError as e:
        raise ImportError("reward 'tanh_reference' needs WeTextProcessing (pip install wetextprocessing==1.2.0)") from e
    cache = knobs.get("TTSRL_CACHE_DIR") / "wetext-reference"
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


def exp_reward(c: float) -> float:
    """exp(-12 c^1.5): c=0 -> 1, c=0.1 -> 0.684, c=0.2 -> 0.342, c=0.5 -> 0.014 (the
    later NVIDIA mair-hub CosyVoice2 tutorial's shape, steeper than tanh_reward past c~0.1)."""
    return math.exp(-12.0 * max(0.0, c) ** 1.5)


def _toneless_variant(ref: str, hyp: str, asr_logprob: float | None):
    c = pinyin_error_rate(ref, hyp, tones=False)
    return tanh_reward(c), c, None


def _exp_toneless_variant(ref: str, hyp: str, asr_logprob: float | None):
    c = pinyin_error_rate(ref, hyp, tones=False)
    return exp_reward(c), c, None


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


@dataclass(frozen=True)
class Reward:
    """A reward variant: its function and what it needs beyond the transcript.

    ``needs_asr_logprob``: the variant reads ``asr_logprob`` (the mean log-likelihood the
    ASR gives the reference text): the server and stage 4 then ask the ASR to score
    (``BackendConfig.want_score``), and a server whose ASR cannot refuses to start."""
    fn: RewardFn  # fn(ref, hyp, asr_logprob) -> (raw reward, error rate, confidence or None)
    help: str
    needs_asr_logprob: bool = False


#: name -> the variant; every CLI's --reward choices are these names
REWARDS: dict[str, Reward] = {
    "tanh": Reward(_tanh_variant, "1 - tanh(3 c) of the toned pinyin error rate c (reference formula, "
                                  "ttsrl normalisation)"),
    "toneless": Reward(_toneless_variant, "1 - tanh(3 c) of the tone-free pinyin error rate"),
    "exp_toneless": Reward(_exp_toneless_variant, "exp(-12 c^1.5) of the tone-free pinyin error rate"),
    "tanh_reference": Reward(_tanh_reference_variant, "tanh with the reference's own WeTextProcessing "
                                                      "normalisation"),
    "cer_nll": Reward(_cer_nll_variant, "harmonic mean of 1 - CER and the ASR's confidence in the reference "
                                        "(needs an ASR that scores text, e.g. whisper)", needs_asr_logprob=True),
}


def reward_variant(name: str) -> Reward:
    """The registered variant ``name``; ValueError naming the choices otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}") from None


def reward_choices_help() -> str:
    """One line per variant, for a CLI's --reward help."""
    return "; ".join(f"{name}: {r.help}" for name, r in REWARDS.items())


def compute_reward(name: str, ref: str, hyp: str, *, asr_logprob: float | None = None,
                   n_tokens: int | None = None,
                   token_rate: float | None = None) -> RewardResult:
    """Reward of transcript ``hyp`` for reference ``ref`` under variant ``name``.

    When ``n_tokens`` (speech tokens generated) is given, the length guard scales the
    reward by ``length_factor(n_tokens, expected_tokens(ref, token_rate))``, at the backend's
    ``token_rate`` (its family's codes per second; required with ``n_tokens``).
    """
    raw, err, conf = reward_variant(name).fn(ref, hyp, asr_logprob)
    factor, ratio, ok = 1.0, None, True
    if n_tokens is not None:
        if token_rate is None:
            raise ValueError("the length guard (n_tokens) needs the backend's token_rate")
        factor, ratio, ok = length_factor(n_tokens, expected_tokens(ref, token_rate))
    return RewardResult(reward=raw * factor, error_rate=err, length_ok=ok, raw_reward=raw,
                        length_factor=factor, length_ratio=ratio, confidence=conf)
