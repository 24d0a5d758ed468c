"""Speech codes + texts -> transcripts, error rates, rewards, failures.

The one scoring function shared by the reward server (what training optimises) and
the evaluator (what stage 4 reports), so the two can never drift apart: same
pipeline call, same reward variant (including the ASR log-likelihood for
``cer_nll``), same length guard, same rule for a failure.

A failure is an utterance with nothing to hear (zero speech codes, or no output at
all): reward 0 and error rate 1 by definition, transcript "". :func:`result_row` turns
a score (or its absence) into the scoring columns of stage 4's per-utterance row, for
a success and a failure alike. Backend errors are not failures here: they
raise, and the caller decides (the server scores the items of that batch one by one
and answers only those that fail alone, 422 for a ValueError, 500 otherwise; the
evaluator stops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ttsrl.reward.backends.base import Audio, SpeechPipeline
from ttsrl.reward.backends.naturalness import FIGURES as MOS_FIGURES  # result-row columns mos_<figure>
from ttsrl.reward.rewards import (
    UNFINISHED_LENGTH_TERM,
    RewardResult,
    compute_reward,
    expected_tokens,
    length_ratio,
    length_term,
    naturalness_term,
)
from ttsrl.text import error_counts

NO_CODES = "no speech codes generated"


@dataclass
class Scored:
    transcript: str
    reward: float
    error_rate: float  # the error rate the reward variant used (1.0 for a failure)
    failure: str | None = None  # why nothing was heard; None when scored
    detail: RewardResult | None = None
    audio: Audio | None = None  # what the ASR heard (for saving wavs)
    sim: float | None = None  # speaker similarity to the prompt (pipeline want_sim); None = not measured
    mos: Any = None  # DNSMOS scores (ttsrl.reward.backends.naturalness.MOS; pipeline want_mos); None = not measured
    cer_term: float = 0.0  # the variant's error-rate reward, no length guard (ttsrl.reward.rewards: r)
    length_term: float = 0.0  # the length/finish term (ttsrl.reward.rewards: l); 0 for a failure
    finished: bool | None = None  # ended with end of speech (None: not known)


def combined_reward(cer_reward: float, sim: float | None, sim_weight: float,
                    ovrl: float | None = None, mos_weight: float = 0.0) -> float:
    """The reward with speaker similarity, GLM-TTS style: the error-rate term plus
    ``sim_weight`` x SIM (GLM-TTS weighs SIM 0.1), plus ``mos_weight`` x the naturalness term of
    DNSMOS OVRL ``ovrl`` (:func:`~ttsrl.reward.rewards.naturalness_term`). Weights 0 give the
    error-rate reward itself; an utterance whose SIM or OVRL could not be measured (too little
    audio, or none) gets no term of it."""
    value = cer_reward
    if sim_weight != 0.0 and sim is not None:
        value += sim_weight * sim
    if mos_weight != 0.0 and ovrl is not None:
        value += mos_weight * naturalness_term(ovrl)
    return value


def finish(scored: Scored, finished: bool | None, length_guard: bool = True) -> Scored:
    """``scored`` for a rollout whose end is known: ``finished`` False (it hit the response limit
    without end of speech) makes its length term ``UNFINISHED_LENGTH_TERM`` (0) and, with the
    length guard on, its reward 0 (no SIM or MOS term either: an unending rollout earns nothing). True or
    None (not known): unchanged. The one place the finish rule is applied (the reward server,
    for the FINISHED input)."""
    if finished is None:
        return scored
    if finished:
        return replace(scored, finished=True)
    return replace(scored, finished=False, length_term=UNFINISHED_LENGTH_TERM,
                   reward=0.0 if length_guard else scored.reward)


def score_codes(pipeline: SpeechPipeline, codes: Sequence[Sequence[int]], texts: Sequence[str], *,
                reward: str = "tanh", length_guard: bool = True, sim_weight: float = 0.0, mos_weight: float = 0.0,
                prompt_wavs: Sequence[str | None] | None = None,
                prompt_ids: Sequence[str | None] | None = None) -> list[Scored]:
    """Transcribe a batch of code sequences and score each against its text: the reward (the
    guarded error-rate reward plus ``sim_weight`` x SIM plus ``mos_weight`` x the naturalness term) and
    its terms (``cer_term``, ``sim``, ``mos``, ``length_term``; their definitions: ``ttsrl.reward.rewards``),
    for a rollout not known to be unfinished (:func:`finish` applies that). The weights: see
    :func:`combined_reward` (they need the pipeline's ``want_sim``, its ``naturalness``).
    ``prompt_wavs``: per sequence, the speaker wav token2wav voices (zero-shot test sets);
    ``prompt_ids``: per sequence, the prompt pool's speaker (the reward server's PROMPT_ID)."""
    wavs = list(prompt_wavs) if prompt_wavs is not None and any(prompt_wavs) else None
    ids = list(prompt_ids) if prompt_ids is not None and any(p is not None for p in prompt_ids) else None
    transcripts = pipeline.transcribe_tokens(codes, texts, wavs, ids)
    out = []
    for c, text, tr in zip(codes, texts, transcripts):
        if len(c) == 0:  # nothing was said: reward 0 by definition
            out.append(Scored("", 0.0, 1.0, failure=NO_CODES))
            continue
        r = compute_reward(reward, text, tr.text, asr_logprob=tr.asr_logprob,
                           n_tokens=len(c) if length_guard else None, token_rate=pipeline.token_rate)
        value = combined_reward(float(r.reward), tr.sim, sim_weight, None if tr.mos is None else tr.mos.ovrl,
                                mos_weight)
        if not math.isfinite(value):
            raise ValueError(f"reward {reward} gave {value} for {text!r}")
        length = (r.length_factor if length_guard  # the guard's factor, already computed
                  else length_term(len(c), expected_tokens(text, pipeline.token_rate)))
        out.append(Scored(tr.text, value, float(r.error_rate), detail=r, audio=tr.audio, sim=tr.sim, mos=tr.mos,
                          cer_term=float(r.raw_reward), length_term=float(length)))
    return out


def result_row(pipeline: SpeechPipeline, text: str, n_codes: int, scored: Scored | None,
               error: str | None = None, codes: Sequence[int] | None = None) -> dict:
    """The scoring columns of one utterance's result row (stage 4's ``results.jsonl``).

    Scored (``scored`` without a failure): the transcript, character and pinyin error
    counts against ``text``, the reward, speaker similarity ``sim`` (None where the
    backend has none), naturalness ``mos_ovrl``/``mos_sig``/``mos_bak`` (DNSMOS P.835; None where not
    measured), ``length_ratio`` (codes generated / codes expected for the
    text at the backend's token rate: the length guard's ratio) and, given ``codes`` and a
    backend whose family has one right reading of a text (kokoro: misaki's phonemes),
    ``reading_errors``/``reading_ref_len``/``reading_error`` (the codes' edit errors against it;
    None elsewhere).

    A failure (``scored`` None: no output, or ``error`` from generation; or a scored
    failure): 100% error, that is errors = reference length in the unit the backend's
    transcripts are compared in (``pipeline.failure_unit``), reward 0, transcript "",
    ``sim`` and ``length_ratio`` None (no speech is a failure, not a ratio of 0), and
    ``error`` saying why."""
    read = pipeline.token2wav.reading_errors(codes, text) if codes is not None else None
    reading = {"reading_errors": None if read is None else read[0], "reading_ref_len": None if read is None else read[1],
               "reading_error": None if read is None or not read[1] else read[0] / read[1]}
    if scored is not None and scored.failure is None and error is None:
        ce, cn = error_counts(text, scored.transcript, "char")
        pe, pn = error_counts(text, scored.transcript, "pinyin")
        return {"length_ratio": length_ratio(n_codes, text, pipeline.token_rate), "transcript": scored.transcript,
                "cer_errors": ce, "ref_len": cn, "pinyin_errors": pe, "pinyin_ref_len": pn,
                "reward": scored.reward, "failure": False, "error": None, "sim": scored.sim,
                **{f"mos_{k}": None if scored.mos is None else getattr(scored.mos, k) for k in MOS_FIGURES}, **reading}
    _, cn = error_counts(text, "", pipeline.failure_unit)
    _, pn = error_counts(text, "", "pinyin")
    return {"length_ratio": None, "transcript": "", "cer_errors": cn, "ref_len": cn, "pinyin_errors": pn,
            "pinyin_ref_len": pn, "reward": 0.0, "failure": True, "sim": None, **{f"mos_{k}": None for k in MOS_FIGURES},
            **reading, "error": error or (scored.failure if scored is not None else None) or NO_CODES}
