"""Stage 4's engine choice: ``auto`` takes vLLM for greedy decoding on a GPU and keeps
sampled evaluation on the transformers engine (whose samples earlier runs were made
with); ``--engine vllm`` samples too, by the same rule (ttsrl/model/vllm_sampling.py).

Whether vLLM is installed is set by each test (a ``vllm`` package made importable from a
temporary folder, or blocked through ``sys.modules``), so both outcomes are checked on every
machine, whichever Python environment runs the suite."""

import importlib.util
import sys

import pytest

from ttsrl.eval.evaluate import EvalConfig, _choose_engine
from ttsrl.model.generate import GenerationConfig


def cfg(engine: str, greedy: bool) -> EvalConfig:
    return EvalConfig(start_model="m", out_dir="o", test_sets=[], engine=engine,
                      generation=GenerationConfig(greedy=greedy))


@pytest.fixture(params=["installed", "absent"])
def vllm(request, monkeypatch, tmp_path):
    """``installed``: an importable ``vllm`` package; ``absent``: ``import vllm`` fails."""
    if request.param == "installed":
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("")
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
        monkeypatch.syspath_prepend(str(tmp_path))
    else:
        monkeypatch.setitem(sys.modules, "vllm", None)  # Python's own import blocker
    assert (importlib.util.find_spec("vllm") is not None) == (request.param == "installed")
    return request.param


def test_auto_samples_on_transformers(vllm):
    assert _choose_engine(cfg("auto", greedy=False), "cuda:0") == "hf"
    assert _choose_engine(cfg("auto", greedy=False), "cpu") == "hf"


def test_greedy_auto_uses_vllm_on_a_gpu_only_when_installed(vllm):
    expected = {"installed": "vllm", "absent": "hf"}[vllm]
    assert _choose_engine(cfg("auto", greedy=True), "cuda:0") == expected
    assert _choose_engine(cfg("auto", greedy=True), "cuda:1") == expected
    assert _choose_engine(cfg("auto", greedy=True), "cpu") == "hf"


def test_an_explicit_engine_is_kept(vllm):
    assert _choose_engine(cfg("vllm", greedy=True), "cpu") == "vllm"  # the user asked: loading tells them
    assert _choose_engine(cfg("hf", greedy=True), "cuda:0") == "hf"
    assert _choose_engine(cfg("hf", greedy=False), "cuda:0") == "hf"
    assert _choose_engine(cfg("vllm", greedy=False), "cuda:0") == "vllm"  # vLLM samples by the rule too
