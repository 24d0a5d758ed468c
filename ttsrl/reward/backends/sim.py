"""Backends of the simulated world (no neural model needed).

* :class:`SimToken2Wav` + :class:`SimASR`: the simulated codec of ``ttsrl.embedded.codec``;
  the "audio" carries only its codes and the ASR decodes them to toned pinyin.
  This is the embedded preset's reward path.
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
    """Passes the codes through: the simulated codec has no waveform."""

    name = "sim"

    def __init__(self):
        from ttsrl.embedded import codec

        self.token_rate = float(codec.TOKEN_RATE)

    def synthesize(self, batch, prompts):
        return [Audio(waveform=None, sample_rate=0, codes=tuple(int(c) for c in codes),
                      token_rate=self.token_rate) for codes in batch]


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
