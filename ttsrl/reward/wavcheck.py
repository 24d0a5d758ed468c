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

Only ``soundfile`` and the standard library are imported here, lazily. Before the venv
exists (``run.sh`` runs ``check_inputs.py`` with the system Python), the same limits are
applied from the RIFF/WAVE header, read with the standard library
(``prompt_wav_header_problem``): every encoding soundfile writes to a .wav (PCM of any
width, float, mu-law/A-law, extensible), not the ``wave`` module's 8/16/24/32-bit PCM only.
"""

from __future__ import annotations

import struct
from pathlib import Path

PROMPT_MIN_RATE = 16000
PROMPT_MAX_S = 30.0
PROMPT_MIN_S = 0.5


def _chunks(f):
    """(chunk id, declared size) of each chunk after a RIFF/WAVE header, the file positioned at
    the chunk's body; whatever the caller reads of it, the next chunk is found from the
    declared size (padded to an even byte count)."""
    while True:
        start = f.tell()
        hdr = f.read(8)
        if len(hdr) < 8:
            return
        n = struct.unpack("<I", hdr[4:])[0]
        yield hdr[:4], n
        f.seek(start + 8 + n + (n & 1))


def _is_riff_wave(head: bytes) -> bool:
    return len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE"


def _wav_truncation(path: Path) -> str | None:
    """For a RIFF/WAVE file: why its data chunk is cut short (None when it is whole)."""
    try:
        with open(path, "rb") as f:
            if not _is_riff_wave(f.read(12)):
                return None
            size = path.stat().st_size
            for cid, n in _chunks(f):
                if cid == b"data":
                    have = size - f.tell()
                    if n != 0xFFFFFFFF and have < n:  # 0xFFFFFFFF: a streamed wav of unknown length
                        return f"truncated: its header declares {n} bytes of audio, the file holds {have}"
                    return None
    except OSError:
        return None
    return None


# formats whose length follows from the data size and block alignment: PCM, IEEE float, A-law,
# mu-law, WAVE_FORMAT_EXTENSIBLE (its subformat is one of these for what soundfile writes)
_BLOCK_FORMATS = (0x0001, 0x0003, 0x0006, 0x0007, 0xFFFE)
# other containers soundfile reads (even named .wav): the venv's check judges them
_OTHER_AUDIO = (b"fLaC", b"OggS", b"FORM", b"RF64", b"BW64", b"caff")


def wav_header(path: Path) -> tuple[int, int, int] | None:
    """(sample rate, frames the header declares, frames the file holds) of a RIFF/WAVE file,
    read with the standard library; None for audio only soundfile judges (another container,
    a compressed encoding); ``ValueError`` for a file that is not audio or whose chunks are
    damaged."""
    with open(path, "rb") as f:
        head = f.read(12)
        if not _is_riff_wave(head):
            if head[:4] in _OTHER_AUDIO:
                return None
            raise ValueError("not a RIFF/WAVE file")
        size = path.stat().st_size
        fmt = None
        for cid, n in _chunks(f):
            if cid == b"fmt ":
                body = f.read(n)
                if len(body) < 16:
                    raise ValueError("its fmt chunk is cut short")
                tag, channels, rate, _, block, _ = struct.unpack("<HHIIHH", body[:16])
                if not (channels and rate and block):
                    raise ValueError(f"its fmt chunk is damaged ({channels} channels, {rate} Hz, "
                                     f"{block}-byte frames)")
                fmt = (tag, rate, block)
            elif cid == b"data":
                if fmt is None:
                    raise ValueError("its data chunk comes before any fmt chunk")
                tag, rate, block = fmt
                if tag not in _BLOCK_FORMATS:
                    return None
                have = size - f.tell()
                declared = have if n == 0xFFFFFFFF else n
                return rate, declared // block, min(declared, have) // block
        raise ValueError("no data chunk" if fmt else "no fmt chunk")


def _too_short(path: Path, frames: int, rate: int) -> str | None:
    seconds = frames / float(rate)
    if seconds < PROMPT_MIN_S:
        return (f"{path}: {seconds:.3f} s ({frames} samples); CosyVoice2's speech tokenizer needs "
                f">= {PROMPT_MIN_S} s of prompt speech")
    return None


def _rate_or_length(path: Path, rate: int, frames: int) -> str | None:
    if rate < PROMPT_MIN_RATE:
        return f"{path}: {rate} Hz (CosyVoice2 needs >= {PROMPT_MIN_RATE} Hz)"
    seconds = frames / float(rate)
    if seconds > PROMPT_MAX_S:
        return f"{path}: {seconds:.1f} s (CosyVoice2 takes <= {PROMPT_MAX_S:.0f} s)"
    return None


def prompt_wav_header_problem(path: str | Path) -> str | None:
    """``prompt_wav_problem`` without soundfile: the same limits and messages, from the
    RIFF/WAVE header (standard library only; ``scripts/check_inputs.py`` before the venv
    exists). None also for audio only soundfile judges: the venv's check does."""
    path = Path(path)
    if not path.is_file():
        return f"{path}: no such file"
    try:
        info = wav_header(path)
    except (OSError, ValueError) as e:
        return f"{path}: not a readable wav ({e})"
    if info is None:
        return None
    rate, declared, frames = info
    why = _rate_or_length(path, rate, declared)
    if why:
        return why
    cut = _wav_truncation(path)
    if cut:
        return f"{path}: {cut}"
    return _too_short(path, frames, rate)


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
    why = _rate_or_length(path, info.samplerate, info.frames)
    if why:
        return why
    cut = _wav_truncation(path)
    if cut:
        return f"{path}: {cut}"
    try:
        data, _ = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        return f"{path}: cannot be read to the end ({e})"
    return _too_short(path, data.shape[0], info.samplerate)


def check_prompt_wav(path: str | Path) -> tuple[int, float]:
    """(sample rate, seconds) of a usable prompt wav; ``ValueError`` with the reason
    otherwise (what the backend calls)."""
    import soundfile as sf

    why = prompt_wav_problem(path)
    if why:
        raise ValueError(f"prompt wav {why}")
    info = sf.info(str(path))
    return info.samplerate, info.frames / float(info.samplerate)
