#!/usr/bin/env python
"""Offline preference optimisation (stage 2 with TRAINER=dpo|kto, second half) on TRL's DPOTrainer / KTOTrainer.

    python train_dpo.py --model exp/hf_model --pairs exp/dpo/pairs.parquet \\
        --out-dir exp/dpo/merged --loss-type sigmoid --beta 0.01 --max-steps 40 --save-steps 10

Loss types (CosyVoice2's DPOLoss family, see ttsrl/train/dpo.py):
  sigmoid   DPO                -log σ(β d)
  cdpo      conservative DPO   -(1-ε) log σ(β d) - ε log σ(-β d)   (--label-smoothing ε)
  ipo       IPO                (d - 1/(2β))²
with d = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected)),
sequence log-probs over the speech tokens (+ end of speech) only, summed (default) or
averaged per token (--average mean, CosyVoice2's choice); --sft-weight adds the chosen
sequence's NLL (RPO / CosyVoice2's CE term). beta defaults to CosyVoice2's 0.01. The
reference log-probs are computed once, before training, by the start model.

--trainer kto runs TRL's KTOTrainer and its own KTO loss (summed log-probs, KL
estimate from mismatched prompt/completion pairs) with chosen as desirable and
rejected as undesirable samples; --loss-type/--average/--sft-weight are DPO-only.

Every --save-steps steps (and at the end) the policy is written to OUT_DIR/step_N in
the merged layout of stage 3 (HF weights + the biased-head class + MERGED.json), so
stage 4 (sweep) and stage 5 (export) read it unchanged. OUT_DIR/RUN.json records the
run's settings: a run into a folder that holds another run's steps starts only with
the same settings (and rewrites every step it saves) or with --force (which deletes
that run's steps first); a step_N not written by this trainer is never touched. One process on CPU; on GPUs
launch through accelerate, e.g. FSDP on 8 GPUs:

    accelerate launch --num_processes 8 --use_fsdp --fsdp_sharding_strategy FULL_SHARD \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer \\
        --fsdp_state_dict_type FULL_STATE_DICT --mixed_precision bf16 train_dpo.py --dtype float32 --bf16-compute ...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ttsrl.cli import add_fields, given, option
from ttsrl.train.dpo import AVERAGES, LOSS_TYPES

DPO_ONLY = ("loss_type", "label_smoothing", "sft_weight", "average")
KTO_ONLY = ("desirable_weight", "undesirable_weight")


@dataclass
class PreferenceRun:
    """The CLI's settings, each with its --help. Fields marked ``run=False`` do not change the
    weights; the others are the run's settings recorded in OUT_DIR/RUN.json."""

    model: str = option(help="converted start model (HF dir); also the reference", run=False)
    pairs: str = option(help="pairs Parquet (mine_pairs.py)", run=False)
    out_dir: str = option(help="OUT_DIR/step_N checkpoints (merged layout)", run=False)
    trainer: str = option("dpo", choices=("dpo", "kto"),
                          help="dpo: paired losses below; kto: TRL's KTO on chosen=desirable, rejected=undesirable")
    loss_type: str = option("sigmoid", choices=LOSS_TYPES, help="(dpo) the paired loss (see above)")
    desirable_weight: float = option(1.0, help="(kto) weight of the desirable (chosen) samples' loss")
    undesirable_weight: float = option(1.0, help="(kto) weight of the undesirable (rejected) samples' loss")
    beta: float = option(0.01, help="DPO/KTO beta (CosyVoice2: 0.01)")
    label_smoothing: float = option(0.0, help="(dpo) cdpo's epsilon in (0, 0.5)")
    sft_weight: float = option(0.0, help="(dpo) weight of the chosen NLL term (RPO)")
    average: str = option("sum", choices=AVERAGES,
                          help="(dpo) sequence log-prob: sum over speech tokens, or per-token mean (CosyVoice2)")
    lr: float = option(1e-5, help="learning rate (constant after the warm-up)")
    batch_size: int = option(8, help="pairs per device per step")
    grad_accum: int = option(1, help="gradient accumulation steps per optimizer step")
    max_steps: int = option(-1, help="optimizer steps (-1: --epochs)")
    epochs: float = option(1.0, help="passes over the pairs (when --max-steps is -1)")
    save_steps: int = option(0, help="save every N steps (0: only at the end)")
    warmup_steps: int = option(0, help="linear learning-rate warm-up steps")
    seed: int = option(0, help="seed of TRL's data order and dropout")
    dtype: str = option("float32", choices=("float32", "bfloat16"),
                        help="dtype the policy is loaded in: its master weights (keep float32 at small learning rates)")
    bf16_compute: bool = option(False, help="compute in bf16 (autocast / FSDP mixed precision) over the --dtype "
                                            "master weights")
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    threads: int = option(0, help="torch CPU threads (0: default)", run=False)
    force: bool = option(False, help="delete the steps of an earlier run with other settings in --out-dir", run=False)

    def run_settings(self) -> dict:
        """The settings that shape the weights (RUN.json), the other trainer's options left out."""
        other = KTO_ONLY if self.trainer == "dpo" else DPO_ONLY
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("run", True) and f.name not in other}

    def precision(self) -> tuple[str, bool]:
        """(dtype the policy is loaded in, i.e. the master weights FSDP/Adam update; whether TRL
        computes in bf16: ``bf16=True``, autocast / accelerate's mixed precision over them)."""
        return self.dtype, self.dtype == "bfloat16" or self.bf16_compute


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: run.sh's lists are checked by whole flags; an abbreviation would slip past
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, PreferenceRun)
    return p


def main(argv=None) -> int:
    p = parser()
    a = PreferenceRun(**given(p.parse_args(argv), PreferenceRun))

    import torch

    from ttsrl.train.dpo import DPOSettings, make_trainer_class, pairs_to_rows
    from ttsrl.train.dpo_console import bars_off_a_terminal, install_console
    from ttsrl.train.dpo_out import OutputDirError, make_save_callback, prepare_out_dir, run_settings
    from ttsrl.train.pairs import PairsError, read_pairs

    settings = DPOSettings(loss_type=a.loss_type, beta=a.beta, label_smoothing=a.label_smoothing,
                           sft_weight=a.sft_weight, average=a.average)
    try:
        settings.check()
    except ValueError as e:
        p.error(str(e))
    if a.trainer == "kto" and a.batch_size < 2:
        p.error("kto needs --batch-size >= 2 (its KL estimate pairs each prompt with another's completion)")
    pairs_path, out_dir = Path(a.pairs), Path(a.out_dir)
    if not pairs_path.is_file():
        print(f"error: --pairs {pairs_path}: no such file (run mine_pairs.py first)", file=sys.stderr)
        return 2
    run = run_settings(a.run_settings(), Path(a.model), pairs_path)
    try:  # before anything slow: a folder that cannot take this run stops it now
        prepare_out_dir(out_dir, run, force=a.force, log=lambda m: print(f"[{a.trainer}] {m}", flush=True),
                        write=os.environ.get("RANK", "0") == "0")  # one writer under accelerate
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    from datasets import Dataset
    from trl import DPOConfig

    from ttsrl.model.hf_model import load_speech_lm

    dtype_name, bf16 = a.precision()
    lm = load_speech_lm(a.model, dtype=getattr(torch, dtype_name))
    try:
        pairs = read_pairs(pairs_path, lm.vocab)
    except PairsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_cpu = not torch.cuda.is_available()
    common = dict(
        output_dir=str(out_dir / ".trainer"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum, learning_rate=a.lr, max_steps=a.max_steps,
        num_train_epochs=a.epochs, warmup_steps=a.warmup_steps, lr_scheduler_type="constant_with_warmup",
        logging_steps=1, save_strategy="no", report_to=[], seed=a.seed, beta=a.beta,
        precompute_ref_log_probs=True, max_length=None, trust_remote_code=True, use_cpu=use_cpu,
        bf16=bf16, gradient_checkpointing=a.gradient_checkpointing,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=bars_off_a_terminal())
    if a.trainer == "dpo":
        ds = Dataset.from_list(pairs_to_rows(pairs, lm.vocab))
        trainer_cls, extra = make_trainer_class(), {"settings": settings}
        cfg = DPOConfig(**common)
        what = f"loss {a.loss_type} (beta {a.beta}, average {a.average}, sft {a.sft_weight})"
        info = {"loss_type": a.loss_type, "average": a.average, "sft_weight": a.sft_weight,
                "label_smoothing": a.label_smoothing}
    else:
        from trl import KTOConfig

        from ttsrl.train.dpo import make_kto_trainer_class, pairs_to_kto_rows

        ds = Dataset.from_list(pairs_to_kto_rows(pairs, lm.vocab))
        trainer_cls, extra = make_kto_trainer_class(), {}
        cfg = KTOConfig(**common, desirable_weight=a.desirable_weight, undesirable_weight=a.undesirable_weight)
        what = f"KTO (beta {a.beta}, weights {a.desirable_weight}/{a.undesirable_weight})"
        info = {"desirable_weight": a.desirable_weight, "undesirable_weight": a.undesirable_weight}
    info = {"source": f"ttsrl {a.trainer} on {a.pairs}", "trainer": a.trainer, "beta": a.beta, **info, "run": run}
    cb = make_save_callback(out_dir, Path(a.model), a.save_steps, info)
    trainer = trainer_cls(model=lm.model, args=cfg, train_dataset=ds, processing_class=lm.tokenizer,
                          callbacks=[cb], **extra)
    cb.trainer = trainer
    install_console(trainer, out_dir / "train_log.jsonl", a.trainer)  # one line per step; the records there
    if trainer.accelerator.is_main_process:
        print(f"[{a.trainer}] {len(pairs)} pairs ({len(ds)} rows), {what}; reference log-probs precomputed "
              f"by the start model", flush=True)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
