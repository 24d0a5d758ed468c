#!/usr/bin/env python
"""Stage 5: export a Hugging Face CosyVoice2 checkpoint back to CosyVoice's llm.pt.

Reads single-file or sharded safetensors, float32 or bfloat16, and writes an fp32
llm.pt that CosyVoice2 loads with strict=True (llm_decoder bias included). The
write is atomic; a missing tensor or a shape mismatch stops with its name.

Either name the checkpoint (--hf-cosyvoice2-llm-path) or let the stage-4 sweep
choose: --from-sweep summary.json picks the step with the lowest headline error rate
(by default the Seed-TTS mean of per-utterance CERs) on the sweep's DEV sets; test sets
are never used to choose, and a sweep without a dev set stops with a message. --step N
overrides. Step 0 is --start-model, step N is --merged-dir/step_N. The choice (which
set chose, by which metric, the dev and test figures of the exported step, or the
override) is written next to the export as OUTPUT.selection.json.
A merged step (one with MERGED.json) is exported only when every file has the size
and sha256 its marker records.
"""

import argparse
import json
import sys
from pathlib import Path

from ttsrl.atomic import atomic_write_text
from ttsrl.model import convert
from ttsrl.model.checkpoint import MARKER, check_merged
from ttsrl.train import steps

RECORD_SUFFIX = ".selection.json"


def selection_record(summary_path: str, step_override: int | None) -> tuple[int, dict]:
    """(step to export, the record of why) from a stage-4 summary.json."""
    rows = json.loads(Path(summary_path).read_text())
    choice = steps.choose_step(rows)
    if step_override is not None:
        step = step_override
        why = f"step {step} given by --step / EXPORT_STEP (overrides the dev-set choice, step {choice['step']})"
    elif choice["step"] is None:
        raise ValueError(f"{summary_path}: {choice['reason']}")
    else:
        step, why = choice["step"], choice["reason"]
    keep = ("test_set", "role", "cer_utt_mean", "cer_pooled", "ci", "above_50", "vs_start", "n")
    record = {"step": step, "chosen_by": "override" if step_override is not None else "dev set",
              "reason": why, "dev_choice": choice, "summary": str(summary_path),
              "rows_of_step": [{k: r.get(k) for k in keep} for r in rows if int(r["step"]) == step]}
    return step, record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-cosyvoice2-llm-path", metavar="DIR", help="HF checkpoint folder to export")
    src.add_argument("--from-sweep", metavar="SUMMARY_JSON", help="choose the step from stage 4's summary.json")
    p.add_argument("--merged-dir", help="with --from-sweep: folder of merged steps (step_N/)")
    p.add_argument("--start-model", help="with --from-sweep: the converted start model (step 0)")
    p.add_argument("--step", type=int, help="with --from-sweep: export this step instead of the dev set's choice")
    p.add_argument("--output-path", required=True, metavar="llm.pt", help="where to write llm.pt")
    p.add_argument("--verify", action="store_true",
                   help="reload the written llm.pt as CosyVoice2's Qwen2LM and compare its logits with the HF model")
    a = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if a.from_sweep:
            if not (a.merged_dir and a.start_model):
                p.error("--from-sweep needs --merged-dir and --start-model")
            step, record = selection_record(a.from_sweep, a.step)
            src_dir = steps.model_dir_for(step, a.start_model, a.merged_dir)
            print(f"exporting step {step}: {record['reason']}\n  from {src_dir}")
        else:
            src_dir = a.hf_cosyvoice2_llm_path
            if (Path(src_dir) / MARKER).is_file():  # a merged step: trust it only when its files hash right
                why = check_merged(Path(src_dir))
                if why is not None:
                    raise ValueError(f"{src_dir} is not a complete, verified step: {why}")
        convert.hf_to_cosyvoice(src_dir, a.output_path)
        print(f"wrote {a.output_path}")
        if a.from_sweep:
            record["model"] = str(src_dir)
            atomic_write_text(Path(a.output_path + RECORD_SUFFIX),
                              json.dumps(record, ensure_ascii=False, indent=2) + "\n")
            print(f"wrote {a.output_path + RECORD_SUFFIX} (why this step)")
        if a.verify:
            diff = convert.verify_export(src_dir, a.output_path)
            print(f"verified: max |logit difference| HF vs llm.pt on a probe batch = {diff:.2e}")
            if diff > 1e-4:
                print("error: exported llm.pt does not reproduce the HF model", file=sys.stderr)
                return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
