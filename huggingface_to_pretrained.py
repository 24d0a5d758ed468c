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
from dataclasses import dataclass
from pathlib import Path

from ttsrl.atomic import atomic_write_text
from ttsrl.cli import add_fields, option, parse_into
from ttsrl.model import convert
from ttsrl.model.checkpoint import MARKER, check_family, check_merged
from ttsrl.train import steps

RECORD_SUFFIX = ".selection.json"


def selection_record(summary_path: str, step_override: int | None) -> tuple[int, dict]:
    """(step to export, the record of why) from a stage-4 summary.json."""
    if not Path(summary_path).is_file():  # a bare [Errno 2] said neither what the file is nor why it is missing
        asked = f" (asked for step {step_override})" if step_override is not None else ""
        raise FileNotFoundError(f"no stage-4 summary {summary_path}{asked}: stage 4 has not run here (bash run.sh 4 4 "
                                "scores the start model and every merged step; stage 5 records the export against "
                                "it), or export one folder with --hf-cosyvoice2-llm-path")
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


@dataclass
class ExportConfig:
    """The export's settings; each field is also its option. One source: a checkpoint folder
    (``hf_cosyvoice2_llm_path``) or stage 4's summary (``from_sweep``, with the step folders)."""
    output_path: str = option(metavar="llm.pt", help="where to write llm.pt")
    hf_cosyvoice2_llm_path: str | None = option(None, metavar="DIR",
                                                help="HF checkpoint folder to export; or --from-sweep")
    from_sweep: str | None = option(None, metavar="SUMMARY_JSON",
                                    help="choose the step from stage 4's summary.json; or --hf-cosyvoice2-llm-path")
    merged_dir: str | None = option(None, metavar="DIR", help="with --from-sweep: folder of merged steps (step_N/)")
    start_model: str | None = option(None, metavar="DIR", help="with --from-sweep: the converted start model (step 0)")
    step: int | None = option(None, metavar="N",
                              help="with --from-sweep: export this step instead of the dev set's choice")
    family: str | None = option(None, metavar="NAME", help="the run's model family (MODEL_FAMILY): a model of "
                                                          "another is refused (none: not checked)")
    verify: bool = option(False, help="reload the written llm.pt as CosyVoice2's Qwen2LM and compare its logits "
                                      "with the HF model")

    def __post_init__(self):
        if (self.hf_cosyvoice2_llm_path is None) == (self.from_sweep is None):
            raise ValueError("give one of --hf-cosyvoice2-llm-path (a checkpoint) or --from-sweep (stage 4 chooses)")
        if self.from_sweep and not (self.merged_dir and self.start_model):
            raise ValueError("--from-sweep needs --merged-dir and --start-model")


def parser() -> argparse.ArgumentParser:
    """One option per field of ExportConfig."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, ExportConfig)
    return p


def main(argv=None) -> int:
    p = parser()
    a = parse_into(p, ExportConfig, p.parse_args(argv))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if a.from_sweep:
            step, record = selection_record(a.from_sweep, a.step)
            src_dir = steps.model_dir_for(step, a.start_model, a.merged_dir)
            print(f"exporting step {step}: {record['reason']}\n  from {src_dir}")
        else:
            src_dir = a.hf_cosyvoice2_llm_path
            if (Path(src_dir) / MARKER).is_file():  # a merged step: trust it only when its files hash right
                why = check_merged(Path(src_dir))
                if why is not None:
                    raise ValueError(f"{src_dir} is not a complete, verified step: {why}")
        what = (f"step {step}" if step else "the start model (step 0)") if a.from_sweep else "the checkpoint"
        check_family(src_dir, a.family, what)
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
