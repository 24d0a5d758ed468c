"""vLLM 0.24 (CPU build, or CUDA with TTSRL_TEST_DEVICE=cuda) serving a converted CosyVoice3
checkpoint through the ttsrl plugin: the head without bias, the 6761 speech/stop rows, and
CosyVoice3's sampling rule in the logits processor, against the transformers class and
CosyVoice3LM (ttsrl.model.cosyvoice_lm).

The checkpoint is a tiny random FAKE of Fun-CosyVoice3-0.5B's LLM in upstream's exact layout
(no llm_embedding, sos/task_id rows of speech_embedding, bias-free llm_decoder): its weights
cannot be had here.
"""

from __future__ import annotations

import json

import pytest
import torch

from ttsrl import knobs

DEVICE = knobs.get("TTSRL_TEST_DEVICE")
TEXTS = ["今天天气很好", "银行的行长在行走", "Hello world", "你好"]
LOGP_TOL = 1e-4 if DEVICE == "cpu" else 5e-3  # as test_vllm_engine.py (its comment says why)


@pytest.fixture(scope="module")
def cv3(tmp_path_factory):
    from ttsrl.embedded.tiny_model import TinyConfig, make_tiny_cosyvoice2
    from ttsrl.model.convert import cosyvoice_to_hf
    from ttsrl.model.generate import VLLMGenerator
    from ttsrl.model.hf_model import load_speech_lm

    d = tmp_path_factory.mktemp("cosyvoice3_hd64")
    # head_dim 64 (vLLM's CPU attention has no kernel for 16)
    ref = make_tiny_cosyvoice2(d / "pretrained", TEXTS * 8, TinyConfig(num_attention_heads=1, num_key_value_heads=1),
                               family="cosyvoice3").eval()
    cosyvoice_to_hf(d / "pretrained", d / "hf", log=lambda _: None)
    lm = load_speech_lm(d / "hf", device=DEVICE)
    gen = VLLMGenerator(str(d / "hf"), lm.vocab, seed=0, dtype="float32", enforce_eager=True,
                        gpu_memory_utilization=0.3, max_model_len=512)
    yield d / "hf", ref, lm, gen
    gen.close()


class _U:
    def __init__(self, i, text):
        self.id, self.text, self.prompt_text, self.prompt_speech = f"u{i}", text, "", []


def _requests(lm):
    from ttsrl.model.generate import make_requests

    return make_requests(lm.tokenizer, [_U(i, t) for i, t in enumerate(TEXTS)])


def test_the_head_has_no_bias_and_the_stop_rows_are_all_200(cv3):
    path, _, lm, gen = cv3
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speech_family"] == "cosyvoice3" and cfg["speech_head_bias"] is False
    assert len(lm.vocab.stop_ids) == 200 and lm.model.lm_head.bias is None
    from vllm import ModelRegistry

    assert cfg["architectures"][0] in ModelRegistry.get_supported_archs()


def test_greedy_equals_transformers_and_cosyvoice3lm(cv3):
    from ttsrl.model.cosyvoice_lm import SamplingConfig
    from ttsrl.model.generate import GenerationConfig, HFGenerator

    _, ref, lm, gen = cv3
    reqs = _requests(lm)
    cfg = GenerationConfig(greedy=True, sampling=SamplingConfig(rule="cosyvoice3-2026", max_token_text_ratio=8.0))
    v = gen.generate(reqs, cfg)
    h = HFGenerator(lm.model, lm.vocab).generate(reqs, cfg)
    assert all(x.error is None for x in v + h), [x.error for x in v + h]
    assert sum(len(x.codes) for x in v) > 20
    if DEVICE == "cpu":
        assert [x.codes for x in v] == [x.codes for x in h]
    for r, a in zip(reqs, v):
        want = list(ref.inference(list(r.text_ids), list(r.prompt_text_ids), sampling=cfg.sampling, greedy=True))
        assert want == a.codes or DEVICE != "cpu"


def test_logprobs_agree(cv3):
    from vllm import SamplingParams

    from ttsrl.model.generate import build_input_ids

    _, _, lm, gen = cv3
    prompts = [build_input_ids(lm.vocab, r) for r in _requests(lm)]
    sp = SamplingParams(temperature=0.0, max_tokens=60, logprobs=0, ignore_eos=True, detokenize=False)
    worst = 0.0
    for p, o in zip(prompts, gen.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)):
        toks = list(o.outputs[0].token_ids)
        vlp = torch.tensor([lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)])
        with torch.no_grad():
            logits = lm.model(torch.tensor([p + toks], device=DEVICE)).logits[0, len(p) - 1:-1].float().cpu()
        hlp = logits.log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        worst = max(worst, (vlp - hlp).abs().max().item())
    print(f"cosyvoice3 log-probs: max |vLLM - transformers| = {worst:.2e}")
    assert worst <= LOGP_TOL


def test_the_rule_never_stops_before_the_minimum_length(cv3):
    """Sampled under cosyvoice3-2026 with a minimum length: no item ends before it (upstream's HF
    loop could, on the 199 stop rows other than 6561), and every id is a speech code."""
    from ttsrl.model.cosyvoice_lm import SamplingConfig
    from ttsrl.model.generate import GenerationConfig

    _, _, lm, gen = cv3
    reqs = _requests(lm) * 4
    reqs = [type(r)(f"{r.key}#{i}", r.text_ids, r.prompt_text_ids, r.prompt_speech) for i, r in enumerate(reqs)]
    cfg = GenerationConfig(sampling=SamplingConfig(rule="cosyvoice3-2026", min_token_text_ratio=3.0,
                                                   max_token_text_ratio=8.0))
    out = gen.generate(reqs, cfg)
    assert all(x.error is None for x in out)
    for r, x in zip(reqs, out):
        assert len(x.codes) >= 3 * len(r.text_ids), (r.key, len(x.codes))
        assert all(0 <= c < 6561 for c in x.codes)
