"""sherpa-onnx offline ASR (SenseVoice or Paraformer model directory).

Imported lazily; ``pip install sherpa-onnx`` and a model directory are needed
(neither ships here). The directory must hold ``tokens.txt`` and either
``model.onnx``/``model.int8.onnx`` of a SenseVoice model (``kind="sense_voice"``)
or of a Paraformer model (``kind="paraformer"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ttsrl.reward.backends.base import ASR, Audio

SAMPLE_RATE = 16000
log = logging.getLogger(__name__)


@dataclass
class SherpaConfig:
    model_dir: str
    kind: str = "sense_voice"  # or "paraformer"
    num_threads: int = 2
    provider: str = "cpu"  # "cuda" needs a CUDA build of sherpa-onnx (PyPI's is CPU-only)
    language: str = "zh"
    strict: bool = False  # provider "cuda" without a CUDA build: error instead of warn + CPU


def sherpa_has_cuda() -> bool:
    """Whether the installed sherpa-onnx was built with onnxruntime's CUDA provider.

    PyPI's wheels are CPU builds (asked for "cuda" they silently run on the CPU); the
    CUDA builds (k2-fsa's ``X.Y.Z+cuda`` wheels) ship ``libonnxruntime_providers_cuda.so``."""
    import importlib.metadata as md

    try:
        dist = md.distribution("sherpa-onnx")
    except md.PackageNotFoundError:
        return False
    if "cuda" in (dist.version or ""):
        return True
    return any("providers_cuda" in str(f) for f in (dist.files or ()))


class SherpaASR(ASR):
    name = "sherpa"

    def __init__(self, cfg: SherpaConfig):
        try:
            import sherpa_onnx  # type: ignore
        except ImportError as e:
            raise ImportError("ASR backend 'sherpa' needs the sherpa-onnx package (pip install sherpa-onnx)") from e
        d = Path(cfg.model_dir)
        model = next((d / n for n in ("model.int8.onnx", "model.onnx") if (d / n).is_file()), None)
        if model is None or not (d / "tokens.txt").is_file():
            raise FileNotFoundError(f"{d} is not a sherpa-onnx model dir (needs model[.int8].onnx and tokens.txt)")
        self.cfg = cfg
        self.provider = cfg.provider
        if cfg.provider == "cuda" and not sherpa_has_cuda():
            msg = ("sherpa-onnx here is a CPU-only build (PyPI's): provider 'cuda' would silently run on "
                   "the CPU; install a CUDA build of sherpa-onnx (k2-fsa's '+cuda' wheels) for GPU ASR")
            if cfg.strict:
                raise RuntimeError(msg)
            log.warning("%s; using provider 'cpu' with %d threads", msg, cfg.num_threads)
            self.provider = "cpu"
        self.name = f"sherpa-{cfg.kind}({self.provider})"
        R = sherpa_onnx.OfflineRecognizer
        if cfg.kind == "sense_voice":
            self._rec = R.from_sense_voice(model=str(model), tokens=str(d / "tokens.txt"),
                                           num_threads=cfg.num_threads, provider=self.provider,
                                           language=cfg.language, use_itn=False)
        elif cfg.kind == "paraformer":
            self._rec = R.from_paraformer(paraformer=str(model), tokens=str(d / "tokens.txt"),
                                          num_threads=cfg.num_threads, provider=self.provider)
        else:
            raise ValueError(f"unknown sherpa model kind {cfg.kind!r} (sense_voice or paraformer)")

    def transcribe(self, audios: Sequence[Audio]) -> list[str]:
        from ttsrl.text import normalize

        streams = []
        for a in audios:
            s = self._rec.create_stream()
            s.accept_waveform(SAMPLE_RATE, a.resampled(SAMPLE_RATE))
            streams.append(s)
        self._rec.decode_streams(streams)
        return [normalize(s.result.text) for s in streams]
