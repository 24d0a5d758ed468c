"""Load a converted (or merged) CosyVoice2 HF checkpoint with its biased speech head.

Uses the package's own copy of the model class, so no remote code is executed and a
checkpoint whose modeling file went missing still loads correctly. A checkpoint in
the stock Qwen2 layout (``--stock-qwen2``) loads as stock Qwen2, with a warning. A folder
written by verl's own merger (a speech head under a stock Qwen2 architecture, bf16) is
refused with a pointer to stage 3.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ttsrl.model import vocab as V


@dataclass
class SpeechLM:
    model: torch.nn.Module
    tokenizer: object
    vocab: V.SpeechVocab


def load_speech_lm(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> SpeechLM:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ttsrl.model.modeling_cosyvoice2 import CosyVoice2Qwen2ForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "speech_output_range", None) is not None:
        arch = list(getattr(config, "architectures", None) or [])
        if arch != [CosyVoice2Qwen2ForCausalLM.__name__]:
            raise ValueError(
                f"{path} holds a CosyVoice2 speech head (speech_output_range) but its config names {arch} "
                f"(dtype {getattr(config, 'dtype', None)}), not {CosyVoice2Qwen2ForCausalLM.__name__}: the "
                "folder verl's own model merger (python -m verl.model_merger) writes, bf16 and without "
                "modeling_cosyvoice2.py, which other tools load as stock Qwen2 without the output bias. "
                "Merge the FSDP checkpoints with stage 3 instead (bash run.sh 3 3, or merge_checkpoints.py "
                "--ckpt-dir CKPT --out-dir OUT): fp32 master weights, the bias kept, every file sha256-checked.")
        model = CosyVoice2Qwen2ForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        warnings.warn(f"{path} is a stock Qwen2 checkpoint: no lm_head bias and no mask on non-speech tokens",
                      stacklevel=2)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return SpeechLM(model.to(device).eval(), tokenizer, V.vocab_of(tokenizer))
