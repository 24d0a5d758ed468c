"""Speech backends: token2wav and ASR behind two small interfaces (see ``base``).

``build_pipeline(cfg, device)`` is the one way the server, the evaluator and the
tests get a :class:`SpeechPipeline`. Backend presets:

=============  =========================  ==================================
``backend``    token2wav                  ASR
=============  =========================  ==================================
``sim``        simulated codec (no audio) ``ttsrl.embedded.codec.decode``
``whisper``    espeak-ng on sim pinyin    Whisper (faster-whisper)
``cosyvoice2`` CosyVoice2 flow + HiFT     Whisper, or sherpa-onnx (``asr``)
=============  =========================  ==================================
"""

from __future__ import annotations

from dataclasses import dataclass

from ttsrl.reward.backends.base import ASR, Audio, SpeakerPrompt, SpeechPipeline, Token2Wav, Transcript, stable_index

BACKENDS = ("sim", "whisper", "cosyvoice2")
ASRS = ("default", "sim", "whisper", "sherpa")

__all__ = ["ASR", "Audio", "BackendConfig", "BACKENDS", "SpeakerPrompt", "SpeechPipeline", "Token2Wav",
           "Transcript", "build_pipeline", "local_devices", "stable_index"]


@dataclass
class BackendConfig:
    backend: str = "sim"
    asr: str = "default"  # override the preset's ASR
    want_score: bool = False  # ask the ASR for log-likelihoods (cer_nll reward)
    want_sim: bool = False  # measure speaker similarity to the prompt (stage 4; the server: --want-sim/--sim-weight)
    whisper_model_dir: str | None = None  # CTranslate2 Whisper dir; None = wheel-shipped base
    whisper_compute_type: str | None = None
    cpu_threads: int = 0
    cosyvoice_checkout: str | None = None
    cosyvoice_model_dir: str | None = None
    prompt_dir: str | None = None
    cosyvoice_batch_flow: bool = False  # CosyVoice2 flow over the whole batch (cosyvoice2_batch)
    sherpa_model_dir: str | None = None
    sherpa_kind: str = "sense_voice"

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {BACKENDS}")
        if self.asr not in ASRS:
            raise ValueError(f"unknown ASR {self.asr!r}; choose from {ASRS}")
        if self.backend == "cosyvoice2" and not self.cosyvoice_model_dir:
            raise ValueError("backend cosyvoice2 needs --cosyvoice-model-dir (and --prompt-dir for "
                             "texts without their own prompt wav, e.g. the reward)")
        if self.asr == "sherpa" and not self.sherpa_model_dir:
            raise ValueError("ASR sherpa needs --sherpa-model-dir")


def local_devices() -> list[str]:
    """``["cuda:0", ...]`` when GPUs are visible, else ``["cpu"]``."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:  # torch missing or broken CUDA: run on CPU
        n = 0
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def _build_asr(cfg: BackendConfig, name: str, device: str) -> ASR:
    if name == "sim":
        from ttsrl.reward.backends.sim import SimASR

        return SimASR()
    if name == "whisper":
        from ttsrl.reward.backends.whisper import WhisperASR, WhisperConfig

        return WhisperASR(WhisperConfig(model_dir=cfg.whisper_model_dir, device=device,
                                        compute_type=cfg.whisper_compute_type, cpu_threads=cfg.cpu_threads))
    if name == "sherpa":
        from ttsrl.reward.backends.sherpa import SherpaASR, SherpaConfig

        return SherpaASR(SherpaConfig(model_dir=cfg.sherpa_model_dir or "", kind=cfg.sherpa_kind,
                                      provider="cuda" if device.startswith("cuda") else "cpu"))
    raise ValueError(f"unknown ASR {name!r}")


def build_pipeline(cfg: BackendConfig, device: str = "cpu") -> SpeechPipeline:
    cfg.validate()
    if cfg.backend == "sim":
        from ttsrl.reward.backends.sim import SimToken2Wav

        t2w: Token2Wav = SimToken2Wav()
        asr_name = "sim"
    elif cfg.backend == "whisper":
        from ttsrl.reward.backends.sim import EspeakToken2Wav

        t2w = EspeakToken2Wav()
        asr_name = "whisper"
    else:
        from ttsrl.reward.backends.cosyvoice2 import CosyVoice2Config, CosyVoice2Token2Wav

        t2w = CosyVoice2Token2Wav(CosyVoice2Config(model_dir=cfg.cosyvoice_model_dir or "",
                                                   prompt_dir=cfg.prompt_dir, checkout=cfg.cosyvoice_checkout,
                                                   device=device, batch_flow=cfg.cosyvoice_batch_flow))
        asr_name = "whisper"
    if cfg.asr != "default":
        asr_name = cfg.asr
    return SpeechPipeline(t2w, _build_asr(cfg, asr_name, device), device, want_score=cfg.want_score,
                          want_sim=cfg.want_sim)
