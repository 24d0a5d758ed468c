"""CosyVoice2's own token2wav (flow matching + HiFT vocoder) from a user's checkout.

Needs a CosyVoice source checkout (``cosyvoice/`` and ``third_party/Matcha-TTS``)
and a model directory (e.g. ``CosyVoice2-0.5B`` with ``flow.pt``, ``hift.pt``,
``campplus.onnx``, ``speech_tokenizer_v2.onnx``, ``cosyvoice2.yaml``). Neither can
be downloaded here, so everything is imported lazily and a missing piece gives a
clear error. Written against CosyVoice's public classes: ``CosyVoice2(model_dir)``,
its ``frontend.frontend_zero_shot`` (to turn a prompt wav into prompt tokens,
features and speaker embedding) and its model's ``token2wav``. Keyword
arguments are matched to the installed version's signatures.

Speaker prompts are the ``*.wav`` files of ``prompt_dir``, each with a ``.txt``
beside it holding its transcript; the pipeline picks one per text deterministically.
"""

from __future__ import annotations

import inspect
import sys
import threading
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import Audio, SpeakerPrompt, Token2Wav


@dataclass
class CosyVoice2Config:
    checkout: str  # CosyVoice source checkout (has cosyvoice/ and third_party/Matcha-TTS)
    model_dir: str  # pretrained model dir (CosyVoice2-0.5B)
    prompt_dir: str  # *.wav (16 kHz or any rate) with a same-named .txt transcript
    device: str = "cuda:0"
    fp16: bool = False


def _import_cosyvoice(checkout: str):
    root = Path(checkout)
    if not (root / "cosyvoice" / "cli" / "cosyvoice.py").is_file():
        raise FileNotFoundError(f"{root} is not a CosyVoice checkout (no cosyvoice/cli/cosyvoice.py); "
                                "clone https://github.com/FunAudioLLM/CosyVoice with its submodules")
    for p in (root, root / "third_party" / "Matcha-TTS"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    try:
        from cosyvoice.cli.cosyvoice import CosyVoice2  # type: ignore
    except ImportError as e:
        raise ImportError(f"cannot import CosyVoice2 from {root}: {e} (install the checkout's requirements)") from e
    return CosyVoice2


def _call(fn, **kwargs):
    """Call ``fn`` with the subset of ``kwargs`` its signature accepts."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class CosyVoice2Token2Wav(Token2Wav):
    name = "cosyvoice2"

    def __init__(self, cfg: CosyVoice2Config):
        import torch

        self.cfg = cfg
        model_dir = Path(cfg.model_dir)
        for f in ("flow.pt", "hift.pt"):
            if not (model_dir / f).is_file():
                raise FileNotFoundError(f"CosyVoice2 model dir {model_dir} lacks {f}")
        CosyVoice2 = _import_cosyvoice(cfg.checkout)
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device))
        self._cv = _call(CosyVoice2, model_dir=str(model_dir), load_jit=False, load_trt=False,
                         load_vllm=False, fp16=cfg.fp16)
        self.sample_rate = int(self._cv.sample_rate)
        self._lock = threading.Lock()
        self._prompts = self._load_prompts(Path(cfg.prompt_dir))

    def _load_prompts(self, prompt_dir: Path) -> tuple[SpeakerPrompt, ...]:
        wavs = sorted(prompt_dir.glob("*.wav"))
        if not wavs:
            raise FileNotFoundError(f"no speaker prompt *.wav in {prompt_dir}")
        prompts = []
        for wav in wavs:
            txt = wav.with_suffix(".txt")
            if not txt.is_file():
                raise FileNotFoundError(f"speaker prompt {wav} has no transcript {txt}")
            fz = self._cv.frontend.frontend_zero_shot
            params = inspect.signature(fz).parameters
            kwargs = dict(tts_text="", prompt_text=txt.read_text(encoding="utf-8").strip(),
                          resample_rate=self.sample_rate, zero_shot_spk_id="")
            if "prompt_wav" in params:  # newer versions load the file themselves
                kwargs["prompt_wav"] = str(wav)
            else:
                from cosyvoice.utils.file_utils import load_wav  # type: ignore

                kwargs["prompt_speech_16k"] = load_wav(str(wav), 16000)
            inp = _call(fz, **kwargs)
            prompts.append(SpeakerPrompt(wav.stem, {
                "prompt_token": inp["flow_prompt_speech_token"],
                "prompt_feat": inp["prompt_speech_feat"],
                "embedding": inp["flow_embedding"],
            }))
        return tuple(prompts)

    @property
    def prompts(self):
        return self._prompts

    def _one(self, codes: Sequence[int], prompt: SpeakerPrompt) -> Audio:
        import torch

        model = self._cv.model
        uid = str(uuidlib.uuid4())
        token = torch.tensor([list(codes)], dtype=torch.int32)
        with self._lock:  # token2wav keeps per-uuid caches in the model object
            for cache in ("hift_cache_dict",):
                getattr(model, cache, {})[uid] = None
            try:
                with torch.inference_mode():
                    wav = _call(model.token2wav, token=token, prompt_token=prompt.data["prompt_token"],
                                prompt_feat=prompt.data["prompt_feat"], embedding=prompt.data["embedding"],
                                token_offset=0, uuid=uid, stream=False, streaming=False, finalize=True,
                                speed=1.0)
            finally:
                getattr(model, "hift_cache_dict", {}).pop(uid, None)
        return Audio(waveform=wav.float().cpu().numpy().reshape(-1).astype(np.float32),
                     sample_rate=self.sample_rate, codes=tuple(int(c) for c in codes))

    def synthesize(self, batch, prompts):
        return [self._one(c, p or self._prompts[0]) for c, p in zip(batch, prompts)]
