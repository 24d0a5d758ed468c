#!/usr/bin/env python
"""Stage 3: merge every saved FSDP step (CKPT/global_step_N/actor) into a Hugging Face
checkpoint OUT/step_N with verl's model merger.

The output loads exactly like the converted base model
(AutoModelForCausalLM.from_pretrained(OUT/step_N, trust_remote_code=True)): the
modeling file that keeps the lm_head bias, tokenizer and generation_config are
included. Re-running skips steps already merged (OUT/step_N/MERGED.json) and redoes
an interrupted one. Note: verl's merger writes bfloat16 weights.

    python merge_checkpoints.py --ckpt-dir exp/checkpoints --out-dir exp/merged \\
        --base-model exp/hf_model
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ttsrl.merge import MergeConfig, MergeError, merge_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, type=Path, help="stage-2 checkpoint folder (trainer.default_local_dir)")
    p.add_argument("--out-dir", required=True, type=Path, help="where step_N folders are written")
    p.add_argument("--base-model", type=Path, default=None,
                   help="the converted HF model trained from: source of the modeling file and side files "
                        "(default: the modeling file shipped in ttsrl)")
    p.add_argument("--steps", type=int, nargs="*", default=None, help="merge only these steps (default: all)")
    args = p.parse_args(argv)
    try:
        results = merge_all(MergeConfig(ckpt_dir=args.ckpt_dir, out_dir=args.out_dir,
                                        base_model=args.base_model, steps=args.steps))
    except MergeError as e:
        print(f"merge_checkpoints: error: {e}", file=sys.stderr)
        return 1
    print(f"merged steps ({len(results)}) in {args.out_dir.resolve()}:")
    for r in results:
        print(f"  step {r.step}: {r.path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
