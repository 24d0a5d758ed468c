"""Speech backends: token2wav and ASR behind two small interfaces (see ``base``).

``build_pipeline(cfg, device)`` is the one way the server, the evaluator and the
tests get a :class:`SpeechPipeline`. Backend presets:

=============  =========================  ==================================
``backend``    token2wav                  ASR
=============  =========================  ==================================
``sim``        simulated codec (no audio) ``ttsrl.embedded.codec.decode``
               (speakers: ``--prompt-dir``)
``whisper``    espeak-ng on sim pinyin    Whisper (faster-whisper)
``kokoro``     Kokoro-82M on phoneme      Whisper; SIM: Resemblyzer against the row's voice
               codes (five voices)
FAMILY         the family's token2wav         Whisper, or sherpa-onnx (``asr``)
               (``Family.token2wav``: CosyVoice2 flow + HiFT, CosyVoice3 DiT + HiFT)
=============  =========================  ==================================

A family with a token2wav (``ttsrl.families``) is a backend of its own name.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from ttsrl.cli import option
from ttsrl.families import family, token2wav_families
from ttsrl.reward.backends.base import ASR, Audio, SpeakerPrompt, SpeechPipeline, Token2Wav, Transcript, stable_index

#: the backends that voice codes with CosyVoice's code and a model folder of their family
COSYVOICE_BACKENDS = token2wav_families()
BACKENDS = ("sim", "whisper", "kokoro") + COSYVOICE_BACKENDS
ASRS = ("default", "sim", "whisper", "sherpa")
SHERPA_KINDS = ("sense_voice", "paraformer")

__all__ = ["ASR", "Audio", "BackendConfig", "BACKENDS", "COSYVOICE_BACKENDS", "SHERPA_KINDS", "SpeakerPrompt",
           "SpeechPipeline", "Token2Wav",
           "Transcript", "build_pipeline", "local_devices", "stable_index"]


@dataclass
class BackendConfig:
    """The backend settings; each field is also the command-line option of every CLI that
    builds a pipeline (``token2wav_asr_server.py``, ``infer_dataset.py``: see ``options``)."""
    backend: str = option("sim", choices=BACKENDS,
                          help="token2wav + ASR preset: sim (simulated codec), whisper (espeak-ng + Whisper), "
                               "kokoro (Kokoro-82M speaking phoneme codes + Whisper; SIM: Resemblyzer), cosyvoice2 (CosyVoice2 flow + HiFT, then Whisper or --asr), cosyvoice3 "
                               "(CosyVoice3 DiT flow + HiFT from --cosyvoice-checkout, then Whisper or --asr)")
    asr: str = option("default", choices=ASRS, help="ASR instead of the preset's ('default': the preset's own)")
    want_score: bool = option(False, cli=False,  # set from the reward's needs (Reward.needs_asr_logprob)
                              help="ask the ASR for the log-likelihood of the reference text")
    want_sim: bool = option(False, cli=False,  # stage 4; the server: --want-sim/--sim-weight
                            help="measure speaker similarity to the prompt")
    want_mos: bool = option(False, cli=False,  # stage 4 (evaluate.scoring_backend); the server: --mos-weight
                            help="measure naturalness (DNSMOS P.835) of each utterance with a waveform")
    whisper_fit_window: bool = option(False, help="Whisper encodes only the seconds the batch's longest audio "
                                      "needs (+1), not its 30 s training window: about 5x less Whisper time on "
                                      "2.5 s utterances, a figure of its own (benchmarks/bench_speech_reward.py)")
    whisper_model_dir: str | None = option(None, metavar="DIR", help="CTranslate2 Whisper directory "
                                           "(none: Whisper-base from the PyPI wheels)")
    whisper_compute_type: str | None = option(None, metavar="TYPE", help="CTranslate2 compute type "
                                              "(none: int8 on CPU, float16 on GPU)")
    cpu_threads: int = option(0, metavar="N", help="threads per CPU backend (0 = all cores, max 8)")
    cosyvoice_checkout: str | None = option(None, metavar="DIR", help="CosyVoice source checkout (backend "
                                            "cosyvoice2; none: the installed cosyvoice package; backend "
                                            "cosyvoice3 needs one with CosyVoice3, which the package lacks)")
    cosyvoice_model_dir: str | None = option(None, metavar="DIR",
                                             help="CosyVoice2-0.5B model directory (backend cosyvoice2), "
                                                  "Fun-CosyVoice3-0.5B-2512 (backend cosyvoice3)")
    prompt_dir: str | None = option(None, metavar="DIR", help="speaker prompts for token2wav: *.wav (>= 16 kHz, "
                                    "<= 30 s), one chosen per text, or the one a reward request names by its "
                                    "stem (PROMPT_ID: the prompt pool); zero-shot test sets use their own "
                                    "(backends cosyvoice2, cosyvoice3); backend sim: the embedded world's pool "
                                    "(DIR/prompt_speech_tokens.jsonl: its ids, its speakers, SIM)")
    cosyvoice_batch_flow: bool = option(False, help="run CosyVoice2's flow over each batch at once (padded, "
                                                    "masked; the same audio up to float error) instead of one "
                                                    "utterance at a time (backend cosyvoice2)")
    sherpa_model_dir: str | None = option(None, metavar="DIR",
                                          help="sherpa-onnx SenseVoice/Paraformer directory (--asr sherpa)")
    sherpa_kind: str = option("sense_voice", choices=SHERPA_KINDS, help="sherpa-onnx model family")

    @property
    def model_dir(self) -> str:
        """The model folder this backend serves, absolute ("" for a backend without one): what the
        reward server publishes as ``model_dir`` so a launcher can tell two servers apart."""
        if self.backend in token2wav_families() and self.cosyvoice_model_dir:
            return os.path.abspath(self.cosyvoice_model_dir)
        return ""

    def served_prompt_ids(self) -> list[str]:
        """The prompt ids a server with these settings knows (PROMPT_ID; its ``prompt_pool_sha1`` is
        their digest), read from the folder without loading a model: what a launcher compares
        with a server that already answers. sim: the ids of ``prompt_dir``'s
        prompt_speech_tokens.jsonl; a family's token2wav: the stems of its ``*.wav``; none without
        ``prompt_dir`` or for whisper (raises ``PoolError`` for a pool sim could not read)."""
        if self.backend == "kokoro":  # its voices, with or without a folder
            from ttsrl.families.kokoro.phonemes import load_vocab

            return sorted(load_vocab().voices)
        if not self.prompt_dir:
            return []
        if self.backend == "sim":
            from ttsrl.data.prompt_pool import read_pool

            return sorted(p.id for p in read_pool(self.prompt_dir, need_text=False).prompts)
        if self.backend in token2wav_families():
            return sorted(w.stem for w in Path(self.prompt_dir).glob("*.wav"))
        return []

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {BACKENDS}")
        if self.asr not in ASRS:
            raise ValueError(f"unknown ASR {self.asr!r}; choose from {ASRS}")
        if self.backend in token2wav_families() and not self.cosyvoice_model_dir:
            raise ValueError(f"backend {self.backend} needs --cosyvoice-model-dir (and --prompt-dir for "
                             "texts without their own prompt wav, e.g. the reward)")
        if self.backend in token2wav_families() and self.cosyvoice_batch_flow \
                and not family(self.backend).token2wav.batch_flow:
            batched = [n for n in token2wav_families() if family(n).token2wav.batch_flow]
            raise ValueError(f"--cosyvoice-batch-flow is backend {', '.join(batched)}'s; backend {self.backend} "
                             "voices one utterance at a time")
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
                                        compute_type=cfg.whisper_compute_type, cpu_threads=cfg.cpu_threads,
                                        fit_window=cfg.whisper_fit_window))
    if name == "sherpa":
        from ttsrl.reward.backends.sherpa import SherpaASR, SherpaConfig

        return SherpaASR(SherpaConfig(model_dir=cfg.sherpa_model_dir or "", kind=cfg.sherpa_kind,
                                      provider="cuda" if device.startswith("cuda") else "cpu"))
    raise ValueError(f"unknown ASR {name!r}")


def _load(path: str):
    """The object a "module:Name" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_pipeline(cfg: BackendConfig, device: str = "cpu") -> SpeechPipeline:
    cfg.validate()
    if cfg.backend == "sim":
        from ttsrl.reward.backends.sim import SimToken2Wav

        t2w: Token2Wav = SimToken2Wav(cfg.prompt_dir)
        asr_name = "sim"
    elif cfg.backend == "whisper":
        from ttsrl.reward.backends.sim import EspeakToken2Wav

        t2w = EspeakToken2Wav()
        asr_name = "whisper"
    elif cfg.backend == "kokoro":
        from ttsrl.reward.backends.kokoro import KokoroConfig, KokoroToken2Wav

        t2w = KokoroToken2Wav(KokoroConfig(cpu_threads=cfg.cpu_threads))
        asr_name = "whisper"
    else:  # a family's token2wav
        spec = family(cfg.backend).token2wav
        Backend, Config = _load(spec.backend), _load(spec.config)
        t2w = Backend(Config(model_dir=cfg.cosyvoice_model_dir or "", family=cfg.backend, prompt_dir=cfg.prompt_dir,
                             checkout=cfg.cosyvoice_checkout, device=device, batch_flow=cfg.cosyvoice_batch_flow))
        asr_name = "whisper"
    if cfg.asr != "default":
        asr_name = cfg.asr
    return SpeechPipeline(t2w, _build_asr(cfg, asr_name, device), device, want_score=cfg.want_score,
                          want_sim=cfg.want_sim, want_mos=cfg.want_mos, cpu_threads=cfg.cpu_threads)
