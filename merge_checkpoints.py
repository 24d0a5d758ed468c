#!/usr/bin/env python
"""Stage 3: merge every saved FSDP step (CKPT/global_step_N/actor) into a Hugging Face
checkpoint OUT/step_N with verl's model merger.

The output loads exactly like the converted base model
(AutoModelForCausalLM.from_pretrained(OUT/step_N, trust_remote_code=True)): the
modeling file that keeps the lm_head bias, tokenizer and generation_config are
included.

Precision: by default the weights are written in the checkpoint's own precision
(the fp32 master weights), bit for bit. verl's own merger casts to bfloat16, which at
lr 1e-6 rounds away most of a run's update; --dtype bf16 does that on request.

Re-running skips a step only when OUT/step_N/MERGED.json is there and every file it
lists is present with its recorded size (weights open as safetensors) at the same
--dtype; a damaged, interrupted or differently merged step is merged again.

Security: the model class is built from the project's own modeling file
(ttsrl/model/modeling_cosyvoice2.py), never from .py files in the checkpoint folder unless
--use-checkpoint-code is given. verl's merger unpickles the FSDP shards
(torch.load(weights_only=False)): merging a checkpoint folder you did not produce can
run its code. Merge only your own checkpoints.

    python merge_checkpoints.py --ckpt-dir exp/checkpoints --out-dir exp/merged \\
        --base-model exp/hf_model
"""

from __future__ import annotations

import argparse
import sys

from ttsrl.cli import add_fields, given
from ttsrl.train.merge import MergeConfig, MergeError, merge_all


def parser() -> argparse.ArgumentParser:
    """One option per field of MergeConfig."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, MergeConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        results = merge_all(MergeConfig(**given(args, MergeConfig)))
    except MergeError as e:
        print(f"merge_checkpoints: error: {e}", file=sys.stderr)
        return 1
    print(f"merged steps ({len(results)}) in {args.out_dir.resolve()}:")
    for r in results:
        print(f"  step {r.step}: {r.path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
