"""sherpa-onnx offline ASR (SenseVoice or Paraformer model directory).

Imported lazily; ``pip install sherpa-onnx`` and a model directory are needed
(neither ships here). The directory must hold ``tokens.txt`` and either
``model.onnx``/``model.int8.onnx`` of a SenseVoice model (``kind="sense_voice"``)
or of a Paraformer model (``kind="paraformer"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .base import ASR, Audio

SAMPLE_RATE = 16000


@dataclass
class SherpaConfig:
    model_dir: str
    kind: str = "sense_voice"  # or "paraformer"
    num_threads: int = 2
    provider: str = "cpu"  # "cuda" with a CUDA build of sherpa-onnx
    language: str = "zh"


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
        R = sherpa_onnx.OfflineRecognizer
        if cfg.kind == "sense_voice":
            self._rec = R.from_sense_voice(model=str(model), tokens=str(d / "tokens.txt"),
                                           num_threads=cfg.num_threads, provider=cfg.provider,
                                           language=cfg.language, use_itn=False)
        elif cfg.kind == "paraformer":
            self._rec = R.from_paraformer(paraformer=str(model), tokens=str(d / "tokens.txt"),
                                          num_threads=cfg.num_threads, provider=cfg.provider)
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
