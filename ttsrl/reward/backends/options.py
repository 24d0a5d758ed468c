"""The backend command-line options, declared once for every CLI that builds a pipeline
(``token2wav_asr_server.py``, ``infer_dataset.py``)."""

from __future__ import annotations

import argparse

from ttsrl.reward.backends import ASRS, BACKENDS, BackendConfig

SHERPA_KINDS = ("sense_voice", "paraformer")


def add_backend_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, cpu_threads: bool = True) -> None:
    """Add --backend, --asr and the backends' model options. ``cpu_threads=False`` for a
    CLI that sets the thread count its own way."""
    d = BackendConfig()
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="token2wav + ASR preset: sim (simulated codec), whisper (espeak-ng + Whisper), "
                        "cosyvoice2 (CosyVoice2 flow + HiFT, then Whisper or --asr) (default: %(default)s)")
    p.add_argument("--asr", choices=ASRS, default=d.asr, help="override the preset's ASR (default: the preset's)")
    p.add_argument("--whisper-model-dir", default=None, metavar="DIR",
                   help="CTranslate2 Whisper directory (default: Whisper-base from the PyPI wheels)")
    p.add_argument("--whisper-compute-type", default=None, metavar="TYPE",
                   help="CTranslate2 compute type (default int8 on CPU, float16 on GPU)")
    if cpu_threads:
        p.add_argument("--cpu-threads", type=int, default=d.cpu_threads, metavar="N",
                       help="threads per CPU backend (0 = all cores, max 8)")
    p.add_argument("--cosyvoice-checkout", default=None, metavar="DIR",
                   help="CosyVoice source checkout (backend cosyvoice2); default: the installed cosyvoice package")
    p.add_argument("--cosyvoice-model-dir", default=None, metavar="DIR",
                   help="CosyVoice2-0.5B model directory (backend cosyvoice2)")
    p.add_argument("--cosyvoice-batch-flow", action="store_true",
                   help="run CosyVoice2's flow over each batch at once (padded, masked; the same audio up to "
                        "float error) instead of one utterance at a time (backend cosyvoice2)")
    p.add_argument("--prompt-dir", default=None, metavar="DIR",
                   help="speaker prompts for token2wav: *.wav (>= 16 kHz, <= 30 s), one chosen per text; "
                        "zero-shot test sets use their own (backend cosyvoice2)")
    p.add_argument("--sherpa-model-dir", default=None, metavar="DIR",
                   help="sherpa-onnx SenseVoice/Paraformer directory (--asr sherpa)")
    p.add_argument("--sherpa-kind", default=d.sherpa_kind, choices=SHERPA_KINDS,
                   help="sherpa-onnx model family (default: %(default)s)")


def backend_config(a: argparse.Namespace, *, want_score: bool = False,
                   cpu_threads: int | None = None) -> BackendConfig:
    """The :class:`BackendConfig` of parsed options (``cpu_threads`` overrides --cpu-threads)."""
    return BackendConfig(backend=a.backend, asr=a.asr, want_score=want_score,
                         whisper_model_dir=a.whisper_model_dir, whisper_compute_type=a.whisper_compute_type,
                         cpu_threads=cpu_threads if cpu_threads is not None else a.cpu_threads,
                         cosyvoice_checkout=a.cosyvoice_checkout, cosyvoice_model_dir=a.cosyvoice_model_dir,
                         prompt_dir=a.prompt_dir, cosyvoice_batch_flow=a.cosyvoice_batch_flow,
                         sherpa_model_dir=a.sherpa_model_dir, sherpa_kind=a.sherpa_kind)
