"""train_dpo.py parses straight into its settings dataclass (help declared on the fields)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import train_dpo
from ttsrl.cli import add_fields, given

BASE = ["--model", "m", "--pairs", "p.parquet", "--out-dir", "o"]


def parse(argv) -> train_dpo.PreferenceRun:
    p = argparse.ArgumentParser()
    add_fields(p, train_dpo.PreferenceRun)
    return train_dpo.PreferenceRun(**given(p.parse_args(argv), train_dpo.PreferenceRun))


def test_flags_as_the_presets_pass_them():
    # presets/gpu8.sh PREF_ARGS: valueless switches and plain values
    run = parse([*BASE, "--dtype", "float32", "--bf16-compute", "--lr", "1e-6", "--beta", "0.01", "--batch-size",
                 "4", "--epochs", "1", "--save-steps", "200", "--gradient-checkpointing"])
    assert run.bf16_compute is True and run.gradient_checkpointing is True and run.force is False
    assert (run.lr, run.beta, run.batch_size, run.epochs, run.save_steps) == (1e-6, 0.01, 4, 1.0, 200)
    with pytest.raises(SystemExit):
        parse([*BASE, "--loss-type", "hinge"])


def test_run_settings_are_the_weight_shaping_fields_of_the_chosen_trainer():
    common = {"trainer", "beta", "lr", "batch_size", "grad_accum", "max_steps", "epochs", "save_steps",
              "warmup_steps", "seed", "dtype", "bf16_compute", "gradient_checkpointing"}
    assert set(parse(BASE).run_settings()) == common | {"loss_type", "label_smoothing", "sft_weight", "average"}
    assert set(parse([*BASE, "--trainer", "kto"]).run_settings()) == common | {"desirable_weight",
                                                                               "undesirable_weight"}


def test_every_field_has_help_in_the_real_parser(capsys):
    with pytest.raises(SystemExit):
        train_dpo.main(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(train_dpo.PreferenceRun):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "weight of the chosen NLL term" in text
