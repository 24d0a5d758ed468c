"""The two backend interfaces (token2wav, ASR) and the pipeline built on them.

Everything that turns speech tokens into a transcript goes through
:class:`SpeechPipeline`: the reward server, the evaluator and the tests. A
backend never needs special-casing by its callers:

* :class:`Token2Wav` turns batches of speech codes (0..6560) plus a speaker prompt
  into :class:`Audio`.
  A backend with a speaker model also measures how much a generated utterance sounds
  like its prompt (``speaker_similarity``; None elsewhere).
* :class:`ASR` turns :class:`Audio` into text and, when ``supports_score`` is true,
  scores a reference text against the audio (mean log-probability per token).

The simulated world's "audio" carries no waveform, only the codes it came from;
the simulated ASR reads those. Real pairs carry a float32 waveform. Both expose
``duration_s`` so length checks work the same everywhere.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ttsrl.atomic import atomic_path
from ttsrl.data.prompt_pool import pool_sha1
from ttsrl.families import token2wav_families


@dataclass(frozen=True)
class SpeakerPrompt:
    """One speaker a token2wav backend can voice. ``data`` is backend-specific
    (CosyVoice2: prompt tokens/features/embedding; espeak: command-line options)."""

    name: str
    data: Any = field(default=None, compare=False, repr=False)


@dataclass
class Audio:
    """Output of a token2wav backend.

    ``waveform`` is mono float32 in [-1, 1] at ``sample_rate`` Hz, or None for a
    backend that produces no sound (the simulated codec); ``codes`` are the speech
    codes the audio was made from (always kept: cheap, and useful to a sim ASR and
    to logs)."""

    waveform: np.ndarray | None
    sample_rate: int
    codes: tuple[int, ...] = ()
    token_rate: float | None = None  # codes per second: the backend's, needed for waveform-less audio

    @property
    def duration_s(self) -> float:
        if self.waveform is None:
            if self.token_rate is None:
                raise ValueError("waveform-less audio needs its backend's token_rate for a duration")
            return len(self.codes) / self.token_rate
        return len(self.waveform) / float(self.sample_rate)

    def resampled(self, rate: int) -> np.ndarray:
        """The waveform at ``rate`` Hz (float32)."""
        if self.waveform is None:
            raise ValueError("this audio has no waveform (simulated backend)")
        wav = np.asarray(self.waveform, dtype=np.float32)
        if rate == self.sample_rate or len(wav) == 0:
            return wav
        # band-limited resampling by FFT truncation/zero-padding (numpy only)
        n_out = max(1, int(round(len(wav) * rate / self.sample_rate)))
        spec = np.fft.rfft(wav.astype(np.float64))
        out_spec = np.zeros(n_out // 2 + 1, dtype=np.complex128)
        m = min(len(spec), len(out_spec))
        out_spec[:m] = spec[:m]
        return (np.fft.irfft(out_spec, n_out) * (n_out / len(wav))).astype(np.float32)

    def write_wav(self, path) -> None:
        """Write 16-bit PCM WAV (atomically); raises for waveform-less audio."""
        import wave

        if self.waveform is None:
            raise ValueError("this audio has no waveform (simulated backend)")
        pcm = (np.clip(self.waveform, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        with atomic_path(path) as tmp, wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(pcm)


class Token2Wav(ABC):
    """Speech codes + speaker prompt -> audio."""

    name: str = "token2wav"
    #: speech codes per second of audio (the length guard's expected token count); each backend sets
    #: its own (its codec's, its model folder's), so no family's rate is assumed here
    token_rate: float
    #: whether ``speaker_similarity`` measures anything (a speaker model: CosyVoice2's campplus)
    has_speaker_model: bool = False
    #: whether its audio is a waveform (what naturalness, DNSMOS, hears; the simulated codec's is codes)
    has_waveform: bool = True

    @property
    def prompts(self) -> Sequence[SpeakerPrompt]:
        """The speakers this backend can voice (at least one)."""
        return (SpeakerPrompt("default"),)

    @property
    def prompt_pool(self) -> Mapping[str, SpeakerPrompt]:
        """The speaker prompts a request may name by id (the wire's PROMPT_ID), by id: the stems of
        the prompt folder's wavs for a backend that clones voices (cosyvoice2, cosyvoice3 with
        ``--prompt-dir``), the ids of the embedded world's pool (sim with ``--prompt-dir``); empty
        for one that cannot (espeak, sim without a pool), which then refuses every id."""
        return {}

    def prompt_from_wav(self, path: str) -> SpeakerPrompt | None:
        """The speaker of this prompt wav (zero-shot evaluation), or None for a backend
        that cannot clone a voice (sim, espeak): it then uses its own speakers."""
        return None

    @abstractmethod
    def synthesize(self, batch: Sequence[Sequence[int]],
                   prompts: Sequence[SpeakerPrompt | None]) -> list[Audio]:
        """One :class:`Audio` per code sequence; ``prompts[i]`` None = default."""

    def reading_errors(self, codes: Sequence[int], text: str) -> tuple[int, int] | None:
        """(edit errors, reference length) of ``codes`` against the codes the family's own front end
        gives ``text`` (the reading its LM was taught), or None for a backend without one (every
        backend but kokoro: a codec's tokens have no one right sequence). Stage 4 reports it beside
        the ASR's error: what the LM wrote, before a voice and an ASR add their own errors."""
        return None

    def speaker_similarity(self, audios: Sequence[Audio],
                           prompts: Sequence[SpeakerPrompt]) -> list[float | None] | None:
        """Per audio, the similarity of its speaker to ``prompts[i]``'s (cosine of the
        backend's own speaker embeddings; None for an audio it cannot embed), or None
        for a backend without a speaker model (sim, espeak)."""
        return None


class ASR(ABC):
    """Audio -> text (and optionally the log-likelihood of a given text)."""

    name: str = "asr"
    supports_score: bool = False
    #: the unit its transcripts are compared in: "char" for text, "pinyin" for an ASR
    #: that writes toned pinyin (the simulated one). A failed utterance (nothing
    #: heard) counts its reference length in this unit, like the successes around it.
    transcript_unit: str = "char"

    @abstractmethod
    def transcribe(self, audios: Sequence[Audio]) -> list[str]:
        """One transcript per audio (raw ASR text; callers normalise)."""

    def score(self, audios: Sequence[Audio], ref_texts: Sequence[str]) -> list[float]:
        """Mean log-probability per token of ``ref_texts[i]`` given ``audios[i]``."""
        raise NotImplementedError(f"ASR backend {self.name!r} cannot score a reference text")


@dataclass
class Transcript:
    """What the pipeline hears in one code sequence."""

    text: str
    n_tokens: int
    duration_s: float
    asr_logprob: float | None = None
    prompt: str | None = None
    audio: "Audio | None" = None  # what the ASR heard (waveform or, for sim, codes)
    sim: float | None = None  # speaker similarity to the prompt (pipeline want_sim; None = not measured)
    mos: "Any | None" = None  # DNSMOS scores (naturalness.MOS; pipeline want_mos; None = not measured)


class UnknownPromptId(ValueError):
    """A prompt id the pipeline's token2wav does not know (the server answers 422)."""


#: sha1 of the sorted ids, one a line: what a server publishes so a run can tell that its rows'
#: prompt ids and the server's pool are the same set (``prompt_pool`` in the model metadata);
#: the pool's own digest (ttsrl.data.prompt_pool), one function for both sides
prompt_pool_sha1 = pool_sha1


def stable_index(key: str, n: int) -> int:
    """A process- and run-independent choice in 0..n-1 (sha1 of ``key``)."""
    if n <= 0:
        raise ValueError("no choices")
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") % n


class SpeechPipeline:
    """token2wav + ASR on one device: speech codes and their texts -> transcripts.

    The speaker prompt is fixed per text (sha1 of the normalised text modulo the
    number of prompts), so the same text is always voiced by the same speaker and
    the reward carries no speaker-lottery noise. A request may name its prompt instead
    (``prompt_ids``, the wire's PROMPT_ID: zero-shot training): an id of the
    token2wav's ``prompt_pool``, and an unknown id raises :class:`UnknownPromptId`, never
    falls back to another speaker.

    ``want_sim``: also measure each utterance's speaker similarity to its prompt
    (``Token2Wav.speaker_similarity``); off by default (it costs a campplus pass), stage 4
    turns it on, the reward server when asked (``--want-sim``, ``--sim-weight``).

    ``want_mos``: also predict each utterance's naturalness (DNSMOS P.835, ``naturalness``); only
    audio with a waveform has one."""

    def __init__(self, token2wav: Token2Wav, asr: ASR, device: str = "cpu", *,
                 want_score: bool = False, want_sim: bool = False, want_mos: bool = False, cpu_threads: int = 0):
        self.token2wav = token2wav
        self.asr = asr
        self.device = device
        self.want_score = want_score and asr.supports_score
        self.want_sim = want_sim
        self.naturalness = None
        if want_mos:
            from ttsrl.reward.backends.naturalness import DNSMOS

            self.naturalness = DNSMOS(cpu_threads)
        #: seconds the last ``transcribe_tokens`` call spent in token2wav and in the ASR
        #: (read by the server's metrics from the same worker thread)
        self.last_stage_seconds: dict[str, float] = {}

    @property
    def name(self) -> str:
        return f"{self.token2wav.name}+{self.asr.name}@{self.device}"

    @property
    def token_rate(self) -> float:
        return self.token2wav.token_rate

    @property
    def failure_unit(self) -> str:
        """Unit of the reference length of a failure (see ``ASR.transcript_unit``)."""
        return self.asr.transcript_unit

    def prompt_for(self, text: str) -> SpeakerPrompt:
        from ttsrl.text import normalize

        prompts = list(self.token2wav.prompts)
        return prompts[stable_index(normalize(text), len(prompts))]

    def prompt_by_id(self, prompt_id: str) -> SpeakerPrompt:
        """The prompt pool's speaker ``prompt_id``; :class:`UnknownPromptId` naming it and how many
        ids this pipeline knows."""
        pool = self.token2wav.prompt_pool
        hit = pool.get(prompt_id)
        if hit is None:
            raise UnknownPromptId(unknown_prompt_message(prompt_id, self.token2wav.name, sorted(pool)))
        return hit

    def transcribe_tokens(self, batch_codes: Sequence[Sequence[int]], texts: Sequence[str],
                          prompt_wavs: Sequence[str | None] | None = None,
                          prompt_ids: Sequence[str | None] | None = None) -> list[Transcript]:
        """``prompt_wavs[i]``: the speaker of item i (zero-shot evaluation); ``prompt_ids[i]``: the
        prompt pool's speaker of item i (the wire's PROMPT_ID; wins over a wav); None = by text."""
        if len(batch_codes) != len(texts) or any(x is not None and len(x) != len(texts)
                                                 for x in (prompt_wavs, prompt_ids)):
            raise ValueError(f"{len(batch_codes)} code sequences but {len(texts)} texts"
                             + (f" and {len(prompt_wavs)} prompt wavs" if prompt_wavs is not None else "")
                             + (f" and {len(prompt_ids)} prompt ids" if prompt_ids is not None else ""))
        named = {i: self.prompt_by_id(p) for i, p in enumerate(prompt_ids or ()) if p is not None}
        out: list[Transcript | None] = [None] * len(batch_codes)
        self.last_stage_seconds = {"token2wav": 0.0, "asr": 0.0}
        live = [i for i, c in enumerate(batch_codes) if len(c) > 0]
        for i, c in enumerate(batch_codes):
            if len(c) == 0:  # nothing to voice: an empty transcript by definition
                out[i] = Transcript(text="", n_tokens=0, duration_s=0.0)
        if live:
            prompts = [named.get(i) or (prompt_wavs and prompt_wavs[i] and self.token2wav.prompt_from_wav(prompt_wavs[i]))
                       or self.prompt_for(texts[i]) for i in live]
            t0 = time.perf_counter()
            audios = self.token2wav.synthesize([list(batch_codes[i]) for i in live], prompts)
            t1 = time.perf_counter()
            hyps = self.asr.transcribe(audios)
            scores = (self.asr.score(audios, [texts[i] for i in live])
                      if self.want_score else [None] * len(live))
            self.last_stage_seconds = {"token2wav": t1 - t0, "asr": time.perf_counter() - t1}
            sims = (self.token2wav.speaker_similarity(audios, prompts) if self.want_sim else None)
            if sims is not None and len(sims) != len(audios):
                raise ValueError(f"{self.token2wav.name}: {len(sims)} similarities for {len(audios)} audios")
            mos = [None] * len(audios)
            if self.naturalness is not None:
                t2 = time.perf_counter()
                mos = self.naturalness.score(audios)
                self.last_stage_seconds["mos"] = time.perf_counter() - t2
            for j, i in enumerate(live):
                out[i] = Transcript(text=hyps[j], n_tokens=len(batch_codes[i]),
                                    duration_s=audios[j].duration_s, asr_logprob=scores[j],
                                    prompt=prompts[j].name, audio=audios[j],
                                    sim=None if sims is None else sims[j], mos=mos[j])
        return out  # type: ignore[return-value]


def unknown_prompt_message(prompt_id: str, backend: str, known: Sequence[str]) -> str:
    """What a request naming an unknown prompt id is told: the id, how many ids there are, a few of them."""
    if not known:
        return (f"unknown prompt id {prompt_id!r}: this server knows 0 prompt ids (backend {backend} "
                + (f"cannot voice a speaker prompt: PROMPT_ID needs backend {', '.join(token2wav_families())} or "
                   "sim with --prompt-dir)" if backend not in token2wav_families() + ("sim",)
                   else "was started without --prompt-dir)"))
    some = ", ".join(repr(k) for k in known[:5]) + (", ..." if len(known) > 5 else "")
    where = ("the ids of its --prompt-dir's prompt_speech_tokens.jsonl" if backend == "sim"
             else "the *.wav stems of its --prompt-dir")
    return f"unknown prompt id {prompt_id!r}: this server knows {len(known)} prompt ids ({where}: {some})"
