"""The one check of a speaker prompt wav, shared by ``scripts/check_inputs.py`` (before
any stage), ``scripts/prompt_tokens.py`` and the CosyVoice2 backend (``token2wav``'s
prompts, zero-shot evaluation).

It reads the file as the backend does (soundfile: any PCM width, float32, mu-law/A-law,
WAVE_FORMAT_EXTENSIBLE, FLAC, ...), to the end, and applies the backend's limits:

* sample rate >= 16 kHz (CosyVoice2's speech tokenizer works at 16 kHz);
* at most 30 s (its speech tokenizer's window);
* at least 0.5 s of audio (a 0-second or 10-sample prompt gives the speech tokenizer
  no frame, and CosyVoice's frontend fails deep inside);
* a WAV whose header declares more audio than the file holds is truncated (a broken
  copy), and said so.

Only ``soundfile`` and the standard library are imported here, lazily.
"""

from __future__ import annotations

import struct
from pathlib import Path

PROMPT_MIN_RATE = 16000
PROMPT_MAX_S = 30.0
PROMPT_MIN_S = 0.5


def _wav_truncation(path: Path) -> str | None:
    """For a RIFF/WAVE file: why its data chunk is cut short (None when it is whole)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return None
            size = path.stat().st_size
            while True:
                hdr = f.read(8)
                if len(hdr) < 8:
                    return None
                cid, n = hdr[:4], struct.unpack("<I", hdr[4:])[0]
                if cid == b"data":
                    have = size - f.tell()
                    if n != 0xFFFFFFFF and have < n:  # 0xFFFFFFFF: a streamed wav of unknown length
                        return f"truncated: its header declares {n} bytes of audio, the file holds {have}"
                    return None
                f.seek(n + (n & 1), 1)
    except OSError:
        return None


def prompt_wav_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a CosyVoice2 prompt wav (None when it can); the message
    starts with the path."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        return f"{path}: no such file"
    try:
        info = sf.info(str(path))
    except Exception as e:  # noqa: BLE001 - libsndfile raises several kinds
        return f"{path}: not an audio file soundfile reads ({e})"
    if info.samplerate < PROMPT_MIN_RATE:
        return f"{path}: {info.samplerate} Hz (CosyVoice2 needs >= {PROMPT_MIN_RATE} Hz)"
    seconds = info.frames / float(info.samplerate)
    if seconds > PROMPT_MAX_S:
        return f"{path}: {seconds:.1f} s (CosyVoice2 takes <= {PROMPT_MAX_S:.0f} s)"
    cut = _wav_truncation(path)
    if cut:
        return f"{path}: {cut}"
    try:
        data, _ = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        return f"{path}: cannot be read to the end ({e})"
    seconds = data.shape[0] / float(info.samplerate)
    if seconds < PROMPT_MIN_S:
        return (f"{path}: {seconds:.3f} s ({data.shape[0]} samples); CosyVoice2's speech tokenizer needs "
                f">= {PROMPT_MIN_S} s of prompt speech")
    return None


def check_prompt_wav(path: str | Path) -> tuple[int, float]:
    """(sample rate, seconds) of a usable prompt wav; ``ValueError`` with the reason
    otherwise (what the backend calls)."""
    import soundfile as sf

    why = prompt_wav_problem(path)
    if why:
        raise ValueError(f"prompt wav {why}")
    info = sf.info(str(path))
    return info.samplerate, info.frames / float(info.samplerate)
