#!/usr/bin/env python
"""Stage -1: convert a CosyVoice llm.pt (CosyVoice2, or Fun-CosyVoice3's llm.pt / llm.rl.pt)
into a Hugging Face Qwen2 checkpoint.

DIR is laid out like the released model: DIR/llm.pt and DIR/CosyVoice-BlankEN/
(Qwen2 config.json + tokenizer). The family is read off llm.pt's keys (--family: insist on
one). The output loads with AutoTokenizer and AutoModelForCausalLM(trust_remote_code=True);
its logits on the speech/stop rows (6564 for CosyVoice2, llm_decoder bias included; 6761 for
CosyVoice3) equal the LLM's, and every other row is masked.
"""

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from ttsrl.cli import add_fields, option, parse_into
from ttsrl.model import convert
from ttsrl.model.cosyvoice_lm import lm_class
from ttsrl.model.vocab import FAMILIES

DTYPES = ("float32", "bfloat16")


@dataclass
class ImportConfig:
    """The conversion's settings; each field is also its option."""
    pretrained_cosyvoice2_path: str = option(metavar="DIR", aliases=("--pretrained-path",),
                                             help="folder with llm.pt and CosyVoice-BlankEN/ (either family)")
    save_path: str = option(metavar="OUT", help="output HF checkpoint folder, written atomically. It must not overlap "
                                               "the input; an existing non-empty folder is replaced only when it is "
                                               "an earlier output of this tool (else --force)")
    force: bool = option(False, help="replace OUT even when it is a file or a non-empty folder this tool did not "
                                     "write (never when it overlaps the input)")
    llm: str = option("llm.pt", help="the LLM file inside DIR (e.g. llm.rl.pt, Fun-CosyVoice3's RL checkpoint)")
    family: str | None = option(None, choices=tuple(FAMILIES),
                                help="refuse an llm.pt of another family (default: read off its keys)")
    dtype: str = option("float32", choices=DTYPES, help="dtype of the written weights (float32: exact)")
    stock_qwen2: bool = option(False, help="write a plain Qwen2ForCausalLM (no lm_head bias, no output mask) for "
                                           "tools that only know stock Qwen2; prints what that loses on a probe batch")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, ImportConfig)
    a = parse_into(p, ImportConfig, p.parse_args(argv))
    t0 = time.time()
    try:
        sv = convert.cosyvoice_to_hf(a.pretrained_cosyvoice2_path, a.save_path, dtype=getattr(torch, a.dtype),
                                     stock=a.stock_qwen2, force=a.force, family=a.family, llm_file=a.llm)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.save_path} in {time.time() - t0:.1f}s")
    if a.stock_qwen2:
        model = lm_class(sv.family).from_pretrained(a.pretrained_cosyvoice2_path, llm_file=a.llm)
        loss = convert.stock_head_loss(model, sv.text_vocab_size)
        print("stock Qwen2 layout: lm_head bias dropped and non-speech rows unmasked. On a random probe batch: "
              f"KL({sv.family.name} || stock) = {loss['kl_stock']:.4f} nats/token "
              f"(bias alone: {loss['kl_no_bias']:.4f}); probability stock puts on non-speech tokens: "
              f"{loss['non_speech_mass_stock']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
