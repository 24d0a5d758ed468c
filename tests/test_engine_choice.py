"""Stage 4's engine choice: vLLM decodes greedily only (it has no CosyVoice2
repetition-aware sampling), so sampled evaluation always runs on the transformers
engine, whose draws go through ttsrl.model.cosyvoice_lm.pick_token."""

import importlib.util

import pytest

from ttsrl.eval.evaluate import EvalConfig, _choose_engine
from ttsrl.model.generate import GenerationConfig


def cfg(engine: str, greedy: bool) -> EvalConfig:
    return EvalConfig(start_model="m", out_dir="o", test_sets=[], engine=engine,
                      generation=GenerationConfig(greedy=greedy))


def test_sampling_never_uses_vllm():
    assert _choose_engine(cfg("auto", greedy=False), "cuda:0") == "hf"
    assert _choose_engine(cfg("auto", greedy=False), "cpu") == "hf"
    with pytest.raises(ValueError, match="--engine vllm needs --greedy"):
        _choose_engine(cfg("vllm", greedy=False), "cuda:0")


def test_greedy_uses_vllm_on_gpu_when_installed():
    have = importlib.util.find_spec("vllm") is not None
    assert _choose_engine(cfg("auto", greedy=True), "cuda:0") == ("vllm" if have else "hf")
    assert _choose_engine(cfg("auto", greedy=True), "cpu") == "hf"
    assert _choose_engine(cfg("vllm", greedy=True), "cpu") == "vllm"
    assert _choose_engine(cfg("hf", greedy=False), "cuda:0") == "hf"
