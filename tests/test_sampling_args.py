"""The sampling options are declared once (SamplingConfig's fields) and read the same by
every CLI that samples: infer_dataset.py (stage 4) and mine_pairs.py (DPO/KTO pairs)."""

from __future__ import annotations

import pytest

import infer_dataset
import mine_pairs
from ttsrl.model.cosyvoice_lm import SamplingConfig

RULE_2024 = "cosyvoice2-2024"

SAMPLING = ["--sampling-rule", RULE_2024, "--top-p", "0.7", "--top-k", "11", "--win-size", "6", "--tau-r", "0.5",
            "--min-token-text-ratio", "0", "--max-token-text-ratio", "9"]


def from_infer(extra):
    argv = ["--start-model", "m", "--out-dir", "o", "--test-set", "t=x.jsonl", "--backend", "sim", *extra]
    return infer_dataset.parse_args(argv).generation.sampling


def from_mine(extra):
    return mine_pairs.parse_args(["--model", "m", "--out", "p.parquet", "--texts", "x.jsonl", *extra]).sampling


def test_both_clis_give_the_same_sampling_config():
    want = SamplingConfig(rule=RULE_2024, top_p=0.7, top_k=11, win_size=6, tau_r=0.5, min_token_text_ratio=0.0,
                          max_token_text_ratio=9.0)
    assert from_infer(SAMPLING) == want and from_mine(SAMPLING) == want
    assert from_infer([]) == from_mine([]) == SamplingConfig()  # CosyVoice2's defaults when none is given
    assert from_mine(["--top-k", "3"]) == SamplingConfig(top_k=3)


@pytest.mark.parametrize("parse", [from_infer, from_mine])
def test_every_sampling_option_has_help_and_bad_values_are_refused(parse, capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    for flag in ("--sampling-rule", "--top-p", "--top-k", "--win-size", "--tau-r", "--min-token-text-ratio",
                 "--max-token-text-ratio"):
        assert flag in text, flag
    assert "keep at most this many tokens" in text  # SamplingConfig.top_k's help
    with pytest.raises(SystemExit):
        parse(["--sampling-rule", "cosyvoice3"])
