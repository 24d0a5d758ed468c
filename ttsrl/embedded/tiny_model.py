"""Small checkpoints in CosyVoice2's (or CosyVoice3's) exact released layout.

``DIR/llm.pt`` (a ``Qwen2LM`` state dict) + ``DIR/CosyVoice-BlankEN/`` (Qwen2
``config.json`` + tokenizer files). Only the sizes differ from the real model; the
speech vocabulary is always the real 6561 + 3. Used by the tests, the benchmark
(at full size) and the embedded preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ttsrl.atomic import atomic_torch_save
from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer
from ttsrl.model import vocab as V
from ttsrl.model.convert import BLANK_EN
from ttsrl.model.cosyvoice_lm import Qwen2LM, lm_class


@dataclass(frozen=True)
class TinyConfig:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tokenizer_vocab: int = 1024
    extra_inner_rows: int = 37  # unused inner-embedding rows past the text ids, as in the real model
    max_position_embeddings: int = 4096
    seed: int = 0


def qwen2_config(cfg: TinyConfig, inner_vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=inner_vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"],
    )


def randomize_(model: Qwen2LM, seed: int, std: float = 0.05) -> None:
    """Give every tensor (biases and norms too) distinct random values, so that a
    conversion that drops or misplaces any of them is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.ndim == 1 and "norm" in _ else 0.0))


def make_tiny_cosyvoice2(out_dir: str | Path, texts: Iterable[str], cfg: TinyConfig = TinyConfig(),
                         model: Qwen2LM | None = None, family: str = "cosyvoice2") -> Qwen2LM:
    """Write a random (or the given) LM of the family (``Qwen2LM``; ``CosyVoice3LM`` for
    cosyvoice3) in the released layout; returns the model."""
    out = Path(out_dir)
    fam = V.family(family)
    tok = train_tokenizer(texts, cfg.tokenizer_vocab)
    save_blank_en(tok, out / BLANK_EN)
    n_text = V.add_cosyvoice_specials(tok, fam)  # ids CosyVoice adds at run time, as in the real model
    inner = qwen2_config(cfg, n_text + cfg.extra_inner_rows)
    inner.save_pretrained(out / BLANK_EN)
    if model is None:
        torch.manual_seed(cfg.seed)
        model = lm_class(fam)(inner)
        randomize_(model, cfg.seed)
    atomic_torch_save(model.state_dict(), out / "llm.pt")
    return model
