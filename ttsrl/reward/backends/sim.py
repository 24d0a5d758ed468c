"""Backends of the simulated world (no neural model needed).

* :class:`SimToken2Wav` + :class:`SimASR`: the simulated codec of ``ttsrl.embedded.codec``;
  the "audio" carries only its codes and the ASR decodes them to toned pinyin.
  This is the embedded preset's reward path. With a prompt pool (``--prompt-dir DIR``:
  ``DIR/prompt_speech_tokens.jsonl``, ``ttsrl.embedded.speakers``) it knows the pool's ids
  (the wire's PROMPT_ID) and has a speaker model: SIM = the share of an utterance's codes in
  its prompt speaker's code book (``ttsrl.embedded.speakers.similarity``).
* :class:`EspeakToken2Wav`: renders the same decoded pinyin as real audio with
  espeak-ng's ``cmn-latn-pinyin`` voice, so a real ASR (Whisper) can listen to
  the simulated codec's output on a CPU-only machine.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ttsrl.reward.backends.base import ASR, Audio, SpeakerPrompt, Token2Wav


class SimToken2Wav(Token2Wav):
    """Passes the codes through: the simulated codec has no waveform. The speaker is in the codes
    themselves (each simulated speaker has its own code book), so "voicing with a prompt" only
    records which prompt the utterance answers; the speaker model compares the two.

    ``prompt_dir``: a prompt pool folder (``DIR/prompt_speech_tokens.jsonl``); its ids are the
    ``prompt_pool`` a request may name, a request naming none gets one chosen by its text (as
    the cosyvoice backends choose a wav), and ``speaker_similarity`` measures SIM. Without it
    the backend has no speakers to compare with (no SIM, no prompt ids): text-only rows."""

    name = "sim"
    has_waveform = False  # its audio is the codes themselves

    def __init__(self, prompt_dir: str | None = None):
        from ttsrl.embedded import codec, speakers

        self.token_rate = float(codec.TOKEN_RATE)
        pool = speakers.read_pool(prompt_dir) if prompt_dir else {}
        self._pool = {pid: SpeakerPrompt(pid, p) for pid, p in sorted(pool.items())}
        self.has_speaker_model = bool(self._pool)

    @property
    def prompts(self):
        return tuple(self._pool.values()) or super().prompts

    @property
    def prompt_pool(self):
        return self._pool

    def synthesize(self, batch, prompts):
        return [Audio(waveform=None, sample_rate=0, codes=tuple(int(c) for c in codes),
                      token_rate=self.token_rate) for codes in batch]

    def speaker_similarity(self, audios, prompts):
        """SIM of each audio's codes to its prompt's speaker (``speakers.similarity``); None
        without a pool (no speaker model) and for a prompt that is not the pool's."""
        from ttsrl.embedded import speakers

        if not self.has_speaker_model:
            return None
        return [speakers.similarity(a.codes, p.data.speaker) if isinstance(p.data, speakers.PoolPrompt) else None
                for a, p in zip(audios, prompts)]


class SimASR(ASR):
    """Decodes simulated codes to space-separated toned pinyin (``ttsrl.embedded.codec.decode``)."""

    name = "sim"
    transcript_unit = "pinyin"  # it writes toned pinyin

    def transcribe(self, audios: Sequence[Audio]) -> list[str]:
        from ttsrl.embedded import codec

        return [codec.decode(list(a.codes)) for a in audios]


ESPEAK_VOICE = "cmn-latn-pinyin"
# Speakers for espeak: pitch settings of the same voice (chosen per text by the pipeline).
ESPEAK_PROMPTS = (SpeakerPrompt("espeak-p40", ("-p", "40")), SpeakerPrompt("espeak-p55", ("-p", "55")))


def espeak_binary() -> str | None:
    return shutil.which("espeak-ng")


def espeak_render(text: str, *, voice: str = ESPEAK_VOICE, speed_wpm: int = 150,
                  extra_args: Sequence[str] = ()) -> Audio:
    """Speak ``text`` with espeak-ng; returns its 22.05 kHz waveform."""
    exe = espeak_binary()
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install -y espeak-ng)")
    cmd = [exe, "-v", voice, "-s", str(speed_wpm), *extra_args, "--stdout", text]
    proc = subprocess.run(cmd, capture_output=True, check=False, timeout=60)
    if proc.returncode != 0 or not proc.stdout:
        raise RuntimeError(f"espeak-ng failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[:200]}")
    with wave.open(io.BytesIO(proc.stdout)) as w:
        rate = w.getframerate()
        frames = w.readframes(w.getnframes())
    pcm = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    return Audio(waveform=pcm, sample_rate=rate)


class EspeakToken2Wav(Token2Wav):
    """Simulated codes -> pinyin (``ttsrl.embedded.codec.decode``) -> espeak-ng audio.

    Codes that decode to nothing give silence as long as the codes would last."""

    name = "espeak"

    def __init__(self, workers: int = 2, speed_wpm: int = 150):
        from ttsrl.embedded import codec

        if espeak_binary() is None:
            raise RuntimeError("backend 'espeak' needs espeak-ng (apt-get install -y espeak-ng)")
        self.token_rate = float(codec.TOKEN_RATE)  # it voices the simulated codec
        self.workers = max(1, workers)
        self.speed_wpm = speed_wpm

    @property
    def prompts(self):
        return ESPEAK_PROMPTS

    def _one(self, codes: Sequence[int], prompt: SpeakerPrompt | None) -> Audio:
        from ttsrl.embedded import codec

        text = codec.decode(list(codes)).strip()
        codes_t = tuple(int(c) for c in codes)
        if not text:
            n = int(16000 * len(codes) / self.token_rate)
            return Audio(waveform=np.zeros(n, dtype=np.float32), sample_rate=16000, codes=codes_t)
        audio = espeak_render(text, speed_wpm=self.speed_wpm, extra_args=(prompt.data if prompt else ()))
        audio.codes = codes_t
        return audio

    def synthesize(self, batch, prompts):
        if len(batch) == 1:
            return [self._one(batch[0], prompts[0])]
        with ThreadPoolExecutor(min(self.workers, len(batch))) as pool:
            return list(pool.map(self._one, batch, prompts))
