"""Build a small Qwen-style byte-level BPE tokenizer.

The released CosyVoice-BlankEN folder holds Qwen2's tokenizer: byte-level BPE with
Qwen's pre-tokenizer regex, NFC normalisation, and the specials ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` right after the regular vocabulary. This module
trains a tokenizer of the same kind on a small corpus, so tests and the embedded
preset use the same loading code as the real model. Every byte is in the base
alphabet, so "\\n" is a single token (verl's Qwen chat handling needs that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ttsrl.model.vocab import QWEN_SPECIALS

QWEN_REGULAR_VOCAB = 151643  # Qwen2's byte-level BPE entries before its special tokens

# Qwen2's pre-tokenisation regex (transformers' Qwen2Tokenizer uses the same).
QWEN_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                          r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024, per_character: bool = False):
    """Train a byte-level BPE on ``texts``; returns a transformers tokenizer whose
    regular vocabulary has at most ``vocab_size`` entries, followed by Qwen's
    three specials.

    ``per_character``: learn merges only inside characters (and inside ASCII words),
    so every character seen becomes one token and no token spans two Chinese
    characters, as Qwen's tokenizer mostly does for common characters."""
    if per_character:
        import re

        texts = list(texts)
        units = set(ch for t in texts for ch in t if not ch.isascii())
        units |= set(w for t in texts for w in re.findall(r"[A-Za-z]+", t))
        texts = sorted(units) * 2  # min_frequency 2
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=QWEN_SPECIALS[0],
                                   pad_token=QWEN_SPECIALS[0], unk_token=None)
    fast.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    return fast


def save_blank_en(tokenizer, out_dir: str | Path) -> None:
    """Save like the released CosyVoice-BlankEN tokenizer files (Qwen2 class)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    # Declare the Qwen2 class so AutoTokenizer loads it the way it loads Qwen's.
    import json
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


def qwen_sized_tokenizer():
    """A byte-level BPE tokenizer with exactly Qwen2's 151643 regular entries followed by
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (ids 151643..151645), like the
    released CosyVoice-BlankEN. Its entries are synthetic: only the sizes and ids are
    real (for checking the real id math and for full-size benchmarks)."""
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({f"x{i}": i for i in range(len(vocab), QWEN_REGULAR_VOCAB)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=QWEN_SPECIALS[0])
    fast.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    return fast
