"""Naturalness: DNSMOS P.835 (Microsoft; the ONNX models inside ``speechmos==0.0.1.1``).

DNSMOS predicts, from audio alone, the 1-5 opinion scores of a P.835 listening test: SIG (the
speech signal), BAK (the background), OVRL (overall), plus a P.808 overall score. It is a
predictor trained on noisy, enhanced speech, not a listening test, and it does not know what was
said (a sentence with wrong syllables scores as one with right ones). ttsrl reports OVRL, SIG and
BAK beside CER and SIM, and OVRL can be a reward term.

The computation is speechmos's own (``speechmos.dnsmos.DNSMOS.__call__``: a clip shorter than
9.01 s is repeated until it is that long, every 9.01 s window a second apart is scored, and the
polynomial that maps the network's outputs to MOS is applied); only the ONNX sessions are built
here, with a thread count of our choosing, since the package's use every core.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ttsrl.reward.backends.base import Audio

SAMPLE_RATE = 16000
#: the three P.835 figures, in the order stage 4's report and the wire carry them
FIGURES = ("ovrl", "sig", "bak")


@dataclass(frozen=True)
class MOS:
    ovrl: float
    sig: float
    bak: float
    p808: float


class DNSMOS:
    """Audio -> DNSMOS P.835 (and P.808) scores, one clip at a time (each is a few 9 s windows)."""

    name = "dnsmos-p835"

    def __init__(self, cpu_threads: int = 0):  # 0: all cores (at most 8), as every CPU backend
        import onnxruntime as ort
        import speechmos.dnsmos as upstream

        models = Path(upstream.__file__).parent / "dnsmos_models"
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = cpu_threads or min(8, os.cpu_count() or 1)
        opts.inter_op_num_threads = 1
        self._model = upstream.DNSMOS.__new__(upstream.DNSMOS)  # its __init__ builds sessions on every core
        self._model.primary_model_path = str(models / "sig_bak_ovr.onnx")
        self._model.onnx_sess = ort.InferenceSession(self._model.primary_model_path, sess_options=opts,
                                                     providers=["CPUExecutionProvider"])
        self._model.p808_onnx_sess = ort.InferenceSession(str(models / "model_v8.onnx"), sess_options=opts,
                                                          providers=["CPUExecutionProvider"])
        self._lock = threading.Lock()

    def score(self, audios: Sequence[Audio]) -> list[MOS | None]:
        """Per audio its scores, or None for one without a waveform or with under 0.1 s of it."""
        out: list[MOS | None] = []
        for a in audios:
            if a.waveform is None or a.duration_s < 0.1:
                out.append(None)
                continue
            wav = np.clip(a.resampled(SAMPLE_RATE), -1.0, 1.0).astype(np.float32)
            with self._lock:
                r = self._model(wav, SAMPLE_RATE, False)
            out.append(MOS(float(r["ovrl_mos"]), float(r["sig_mos"]), float(r["bak_mos"]), float(r["p808_mos"])))
        return out
