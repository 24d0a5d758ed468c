#!/usr/bin/env python
"""Offline preference optimisation (stage 2 with TRAINER=dpo|kto, second half) on TRL's DPOTrainer / KTOTrainer.

    python train_dpo.py --model exp/hf_model --pairs exp/dpo/pairs.parquet \\
        --out-dir exp/dpo/merged --loss-type sigmoid --beta 0.1 --max-steps 40 --save-steps 10

The loss is TRL's own code (DPOTrainer._compute_loss / KTOTrainer's): ttsrl only makes the speech
LM answer TRL's fused-head call through its speech rows (ttsrl/train/dpo.py). Every loss setting
below is TRL's, named as in DPOConfig / KTOConfig, with TRL's help, default and choices read from
TRL's config classes. Log-probs cover the speech tokens + end of speech, never the prompt; the
reference log-probs are computed once, before training, by the start model.

  --loss-type sigmoid                 DPO (sequence log-probs summed)
  --loss-type sigmoid_norm            DPO on per-token mean log-probs (Tulu 3, CosyVoice2)
  --loss-type sigmoid,sft --loss-weights 1,0.5   RPO: + 0.5 x the chosen NLL
  --ld-alpha 0.5                      LD-DPO: the tail of the longer completion weighted 0.5
  --f-divergence-type js_divergence   f-DPO
  --loss-type sigmoid,robust --loss-weights 1.8,-0.8 --label-smoothing 0.1
                                      cDPO (label smoothing 0.1) on summed log-probs, exactly: TRL 1.16
                                      reads label_smoothing only in robust, exo_pair and aot*

--recipe cosyvoice2 is CosyVoice2's own DPO (its DPOLoss: beta 0.01, per-token mean log-probs):
TRL's sigmoid_norm; with --loss-type ipo its IPO (TRL's ipo averages per token too); with
--cdpo-label-smoothing EPS its cDPO, the one loss term ttsrl adds to TRL's (TRL has no label
smoothing on a per-token mean loss). Options typed on the command line win over the recipe.
tests/test_dpo.py shows TRL's loss equal to CosyVoice2's formula on fixed log-probs.

--trainer kto runs TRL's KTOTrainer and its loss (--loss-type kto or apo_zero_unpaired, summed
log-probs, KL estimate from mismatched prompt/completion pairs) with chosen as desirable and
rejected as undesirable samples.

ORPO and CPO are not offered: TRL 1.16 has them only as experimental trainers
(trl.experimental.orpo, .cpo) on TRL's older pipeline, which tokenises text prompt/chosen/rejected
strings itself (tokenize_row) and takes full-vocabulary logits from a plain forward, not the
fused-head path DPOTrainer and KTOTrainer share; speech pairs are token ids with no text form.

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
from typing import Optional

from trl.trainer.dpo_config import DPOConfig
from trl.trainer.kto_config import KTOConfig

from ttsrl.cli import add_fields, given, option
from ttsrl.train.dpo import RECIPES, trl_choices, trl_default, trl_field

DPO_LOSS_TYPES = trl_choices(DPOConfig, "loss_type")
KTO_LOSS_TYPES = trl_choices(KTOConfig, "loss_type")
DPO_ONLY = ("recipe", "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "label_smoothing",
            "use_weighting", "discopop_tau", "cdpo_label_smoothing")
KTO_ONLY = ("desirable_weight", "undesirable_weight")


def trl_option(config, name: str, prefix: str = "", **meta):
    """A field that is TRL's config field ``name``: TRL's default and help (and choices, where TRL declares them)."""
    f = trl_field(config, name)
    return option(trl_default(config, name), help=prefix + " ".join(f.metadata["help"].split()), **meta)


@dataclass
class PreferenceRun:
    """The CLI's settings, each with its --help. Fields marked ``run=False`` do not change the
    weights; the others are the run's settings recorded in OUT_DIR/RUN.json."""

    model: str = option(help="converted start model (HF dir); also the reference", run=False)
    pairs: str = option(help="pairs Parquet (mine_pairs.py)", run=False)
    out_dir: str = option(help="OUT_DIR/step_N checkpoints (merged layout)", run=False)
    trainer: str = option("dpo", choices=("dpo", "kto"),
                          help="dpo: TRL's DPOTrainer on the pairs; kto: TRL's KTOTrainer on chosen=desirable, "
                               "rejected=undesirable")
    recipe: str = option("trl", choices=tuple(RECIPES),
                         help="(dpo) defaults of the loss settings: trl = TRL's; cosyvoice2 = CosyVoice2's DPO "
                              "(loss_type sigmoid_norm, beta 0.01); typed options win",
                         run=False)  # RUN.json records the values it gave, which are what shape the weights
    loss_type: tuple[str, ...] = option(
        (), choices=tuple(dict.fromkeys(DPO_LOSS_TYPES + KTO_LOSS_TYPES)), metavar="TYPE[,TYPE...]",
        help=f"TRL's loss_type (default: the recipe's, else TRL's: {','.join(trl_default(DPOConfig, 'loss_type'))} "
             f"for dpo, {trl_default(KTOConfig, 'loss_type')} for kto). dpo: one or more of {', '.join(DPO_LOSS_TYPES)} "
             f"(several: summed with --loss-weights); kto: one of {', '.join(KTO_LOSS_TYPES)}")
    loss_weights: Optional[tuple[float, ...]] = trl_option(DPOConfig, "loss_weights", "(dpo; comma-separated, a "
                                                           "negative first one as --loss-weights=-1,2) ")
    beta: float = trl_option(DPOConfig, "beta")
    label_smoothing: float = trl_option(DPOConfig, "label_smoothing", "(dpo) ")
    ld_alpha: Optional[float] = trl_option(DPOConfig, "ld_alpha", "(dpo) ")
    f_divergence_type: str = trl_option(DPOConfig, "f_divergence_type", "(dpo) ",
                                        choices=trl_choices(DPOConfig, "f_divergence_type"))
    f_alpha_divergence_coef: float = trl_option(DPOConfig, "f_alpha_divergence_coef", "(dpo) ")
    use_weighting: bool = trl_option(DPOConfig, "use_weighting", "(dpo) ")
    discopop_tau: float = trl_option(DPOConfig, "discopop_tau", "(dpo) ")
    cdpo_label_smoothing: float = option(
        0.0, help="(dpo, ttsrl's, not TRL's) conservative DPO's label smoothing in (0, 0.5) on loss type "
                  "sigmoid_norm: CosyVoice2's cDPO on per-token means, which no TRL 1.16 loss type gives")
    desirable_weight: float = trl_option(KTOConfig, "desirable_weight", "(kto) ")
    undesirable_weight: float = trl_option(KTOConfig, "undesirable_weight", "(kto) ")
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
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self) if f.metadata.get("run", True) and f.name not in other}

    def precision(self) -> tuple[str, bool]:
        """(dtype the policy is loaded in, i.e. the master weights FSDP/Adam update; whether TRL
        computes in bf16: ``bf16=True``, autocast / accelerate's mixed precision over them)."""
        return self.dtype, self.dtype == "bfloat16" or self.bf16_compute

    def trl_loss_settings(self) -> dict:
        """The loss settings as TRL's config takes them."""
        if self.trainer == "kto":
            return {"loss_type": self.loss_type[0], "beta": self.beta, "desirable_weight": self.desirable_weight,
                    "undesirable_weight": self.undesirable_weight}
        return {"loss_type": list(self.loss_type), "beta": self.beta, "label_smoothing": self.label_smoothing,
                "loss_weights": list(self.loss_weights) if self.loss_weights else None, "ld_alpha": self.ld_alpha,
                "f_divergence_type": self.f_divergence_type, "f_alpha_divergence_coef": self.f_alpha_divergence_coef,
                "use_weighting": self.use_weighting, "discopop_tau": self.discopop_tau}


def resolve(p: argparse.ArgumentParser, typed: dict) -> PreferenceRun:
    """The run: the recipe's values over the defaults, the typed values over both, loss_type's default the
    trainer's; an option of the other trainer is a usage error."""
    trainer = typed.get("trainer", "dpo")
    other = KTO_ONLY if trainer == "dpo" else DPO_ONLY
    wrong = [k for k in typed if k in other]
    if wrong:
        p.error(f"--trainer {trainer} takes no " + ", ".join("--" + k.replace("_", "-") for k in wrong))
    values = {**RECIPES[typed.get("recipe", "trl")], **typed}
    if not values.get("loss_type"):
        values["loss_type"] = trl_default(DPOConfig if trainer == "dpo" else KTOConfig, "loss_type")
        values["loss_type"] = values["loss_type"] if isinstance(values["loss_type"], tuple) else (values["loss_type"],)
    allowed = DPO_LOSS_TYPES if trainer == "dpo" else KTO_LOSS_TYPES
    bad = [x for x in values["loss_type"] if x not in allowed]
    if bad or (trainer == "kto" and len(values["loss_type"]) != 1):
        p.error(f"--trainer {trainer}: --loss-type {','.join(values['loss_type'])}: TRL's "
                f"{'DPOConfig' if trainer == 'dpo' else 'KTOConfig'} takes "
                + ("one or more of " if trainer == "dpo" else "one of ") + ", ".join(allowed))
    return PreferenceRun(**values)


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: run.sh's lists are checked by whole flags; an abbreviation would slip past
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, PreferenceRun)
    return p


def main(argv=None) -> int:
    p = parser()
    a = resolve(p, given(p.parse_args(argv), PreferenceRun))

    import torch

    from ttsrl.train.dpo import make_trainer_class, pairs_to_rows
    from ttsrl.train.dpo_console import bars_off_a_terminal, install_console
    from ttsrl.train.dpo_out import OutputDirError, make_save_callback, prepare_out_dir, run_settings
    from ttsrl.train.pairs import PairsError, read_pairs

    if a.trainer == "kto" and a.batch_size < 2:
        p.error("kto needs --batch-size >= 2 (its KL estimate pairs each prompt with another's completion)")
    pairs_path, out_dir = Path(a.pairs), Path(a.out_dir)
    if not pairs_path.is_file():
        print(f"error: --pairs {pairs_path}: no such file (run mine_pairs.py first)", file=sys.stderr)
        return 2
    dtype_name, bf16 = a.precision()
    use_cpu = not torch.cuda.is_available()
    common = dict(
        output_dir=str(out_dir / ".trainer"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum, learning_rate=a.lr, max_steps=a.max_steps,
        num_train_epochs=a.epochs, warmup_steps=a.warmup_steps, lr_scheduler_type="constant_with_warmup",
        logging_steps=1, save_strategy="no", report_to=[], seed=a.seed,
        precompute_ref_log_probs=True, max_length=None, trust_remote_code=True, use_cpu=use_cpu,
        bf16=bf16, gradient_checkpointing=a.gradient_checkpointing,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=bars_off_a_terminal())
    loss = a.trl_loss_settings()
    try:  # TRL's own checks of its settings, before anything slow
        cfg = (DPOConfig if a.trainer == "dpo" else KTOConfig)(**common, **loss)
    except ValueError as e:
        p.error(str(e))
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

    from ttsrl.model.hf_model import load_speech_lm

    lm = load_speech_lm(a.model, dtype=getattr(torch, dtype_name))
    try:
        pairs = read_pairs(pairs_path, lm.vocab)
    except PairsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.trainer == "dpo":
        ds = Dataset.from_list(pairs_to_rows(pairs, lm.vocab))
        trainer_cls, extra = make_trainer_class(), {"cdpo_label_smoothing": a.cdpo_label_smoothing}
        info = {**loss, "cdpo_label_smoothing": a.cdpo_label_smoothing}
    else:
        from ttsrl.train.dpo import make_kto_trainer_class, pairs_to_kto_rows

        ds = Dataset.from_list(pairs_to_kto_rows(pairs, lm.vocab))
        trainer_cls, extra = make_kto_trainer_class(), {}
        info = loss
    what = ", ".join(f"{k}={v}" for k, v in info.items() if v is not None)
    info = {"source": f"ttsrl {a.trainer} on {a.pairs}", "trainer": a.trainer, **info, "run": run}
    cb = make_save_callback(out_dir, Path(a.model), a.save_steps, info)
    try:
        trainer = trainer_cls(model=lm.model, args=cfg, train_dataset=ds, processing_class=lm.tokenizer,
                              callbacks=[cb], **extra)
    except ValueError as e:  # TRL's checks of a combination (e.g. an f-divergence its loss types lack)
        print(f"error: {e}", file=sys.stderr)
        return 2
    cb.trainer = trainer
    install_console(trainer, out_dir / "train_log.jsonl", a.trainer)  # one line per step; the records there
    if trainer.accelerator.is_main_process:
        print(f"[{a.trainer}] {len(pairs)} pairs ({len(ds)} rows), {type(cfg).__name__}({what}); reference "
              "log-probs precomputed by the start model", flush=True)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
