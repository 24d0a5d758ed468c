"""train_dpo.py parses straight into its settings dataclass (help declared on the fields); its loss
settings are TRL's, with TRL's names, help, defaults and choices read from TRL's config classes."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from trl.trainer.dpo_config import DPOConfig
from trl.trainer.kto_config import KTOConfig

import train_dpo
from ttsrl.cli import given
from ttsrl.train.dpo import trl_choices, trl_default

BASE = ["--model", "m", "--pairs", "p.parquet", "--out-dir", "o"]


def parse(argv) -> train_dpo.PreferenceRun:
    p = train_dpo.parser()
    return train_dpo.resolve(p, given(p.parse_args(argv), train_dpo.PreferenceRun))


def test_flags_as_the_presets_pass_them():
    # presets/gpu8.sh PREF_ARGS: valueless switches and plain values
    run = parse([*BASE, "--dtype", "float32", "--bf16-compute", "--lr", "1e-6", "--beta", "0.01", "--batch-size",
                 "4", "--epochs", "1", "--save-steps", "200", "--gradient-checkpointing"])
    assert run.bf16_compute is True and run.gradient_checkpointing is True and run.force is False
    assert (run.lr, run.beta, run.batch_size, run.epochs, run.save_steps) == (1e-6, 0.01, 4, 1.0, 200)
    with pytest.raises(SystemExit):
        parse([*BASE, "--loss-type", "cdpo"])  # ttsrl's former name: not one of TRL's


def test_loss_settings_are_trls_with_trls_defaults():
    run = parse(BASE)
    assert run.loss_type == trl_default(DPOConfig, "loss_type") and run.beta == trl_default(DPOConfig, "beta")
    settings = run.trl_loss_settings()
    cfg = DPOConfig(output_dir="unused", use_cpu=True, bf16=False, **settings)  # every name is DPOConfig's
    assert {k: getattr(cfg, k) for k in settings} == {k: trl_default(DPOConfig, k) if k != "loss_type"
                                                      else list(trl_default(DPOConfig, k)) for k in settings}
    run = parse([*BASE, "--loss-type", "sigmoid,sft", "--loss-weights", "1,0.5", "--ld-alpha", "0.5",
                 "--f-divergence-type", "alpha_divergence", "--f-alpha-divergence-coef", "0.3", "--use-weighting"])
    assert run.trl_loss_settings() | {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]} == \
        run.trl_loss_settings()
    assert (run.ld_alpha, run.f_divergence_type, run.f_alpha_divergence_coef, run.use_weighting) == (
        0.5, "alpha_divergence", 0.3, True)
    kto = parse([*BASE, "--trainer", "kto"])
    assert kto.trl_loss_settings()["loss_type"] == trl_default(KTOConfig, "loss_type")
    KTOConfig(output_dir="unused", use_cpu=True, bf16=False, **kto.trl_loss_settings())


def test_the_choices_are_read_from_trl():
    assert train_dpo.DPO_LOSS_TYPES == trl_choices(DPOConfig, "loss_type")
    assert {"sigmoid", "ipo", "sigmoid_norm", "robust", "apo_zero", "sft"} <= set(train_dpo.DPO_LOSS_TYPES)
    assert train_dpo.KTO_LOSS_TYPES == tuple(next(f for f in dataclasses.fields(KTOConfig)
                                                  if f.name == "loss_type").metadata["choices"])
    flags = {a.dest: a for a in train_dpo.parser()._actions}
    assert flags["f_divergence_type"].choices == trl_choices(DPOConfig, "f_divergence_type")
    assert "js_divergence" in flags["f_divergence_type"].choices

    @dataclasses.dataclass
    class Fake:  # the three places a TRL config may declare them
        a: str = dataclasses.field(default="x", metadata={"help": "h", "choices": ["x", "y"]})
        b: typing.Literal["p", "q"] = dataclasses.field(default="p", metadata={"help": "h"})
        c: str = dataclasses.field(default="u", metadata={"help": "Possible values are: `'u'`, `v` (x). More."})
        d: str = dataclasses.field(default="u", metadata={"help": "Anything."})

    assert (trl_choices(Fake, "a"), trl_choices(Fake, "b"), trl_choices(Fake, "c")) == (("x", "y"), ("p", "q"),
                                                                                          ("u", "v"))
    with pytest.raises(ValueError, match="declares no choices"):
        trl_choices(Fake, "d")


def test_the_cosyvoice2_recipe_and_what_wins_over_it():
    run = parse([*BASE, "--recipe", "cosyvoice2"])
    assert (run.loss_type, run.beta) == (("sigmoid_norm",), 0.01)
    run = parse([*BASE, "--recipe", "cosyvoice2", "--loss-type", "ipo", "--beta", "0.05"])
    assert (run.loss_type, run.beta, run.recipe) == (("ipo",), 0.05, "cosyvoice2")


@pytest.mark.parametrize("argv,message", [
    (["--trainer", "kto", "--recipe", "cosyvoice2"], "--trainer kto takes no --recipe"),
    (["--trainer", "kto", "--ld-alpha", "0.5"], "--trainer kto takes no --ld-alpha"),
    (["--desirable-weight", "2"], "--trainer dpo takes no --desirable-weight"),
    (["--trainer", "kto", "--loss-type", "sigmoid"], "KTOConfig takes one of kto, apo_zero_unpaired"),
    (["--loss-type", "kto"], "DPOConfig takes one or more of sigmoid"),
])
def test_an_option_of_the_other_trainer_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse([*BASE, *argv])
    assert message in capsys.readouterr().err


def test_run_settings_are_the_weight_shaping_fields_of_the_chosen_trainer():
    common = {"trainer", "loss_type", "beta", "lr", "batch_size", "grad_accum", "max_steps", "epochs", "save_steps",
              "warmup_steps", "seed", "dtype", "bf16_compute", "gradient_checkpointing"}
    assert set(parse(BASE).run_settings()) == common | set(train_dpo.DPO_ONLY) - {"recipe"}  # its values count
    assert set(parse([*BASE, "--trainer", "kto"]).run_settings()) == common | set(train_dpo.KTO_ONLY)
    assert parse(BASE).run_settings()["loss_type"] == ["sigmoid"]  # as RUN.json reads it back


def test_every_field_has_help_in_the_real_parser(capsys):
    with pytest.raises(SystemExit):
        train_dpo.main(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(train_dpo.PreferenceRun):
        assert "--" + f.name.replace("_", "-") in text, f.name
    flat = " ".join(text.split())
    ld_help = " ".join(next(f for f in dataclasses.fields(DPOConfig) if f.name == "ld_alpha").metadata["help"].split())
    assert ld_help[:60] in flat  # TRL's own help
    assert "ORPO and CPO are not offered" in flat and "cosyvoice2" in flat
