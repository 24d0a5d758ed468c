"""Qwen2LM (the CosyVoice2 reference implementation): loss layout and sampling rules."""

import pytest
import torch

from ttsrl import vocab as V
from ttsrl.cosyvoice_lm import SamplingConfig, nucleus_sampling, ras_sampling


def _force_head(model, favourite: int, stop_bias: float):
    """A copy of the model whose head always prefers ``favourite`` and gives the stop
    tokens ``stop_bias``."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.llm_decoder.weight.zero_()
        m.llm_decoder.bias.fill_(-20.0)
        m.llm_decoder.bias[favourite] = 0.0
        m.llm_decoder.bias[V.SPEECH_TOKEN_SIZE:] = stop_bias
    return m


def test_min_length_then_stop(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    text = [3, 4, 5]
    cfg = SamplingConfig()
    min_len = int(len(text) * cfg.min_token_text_ratio)
    greedy = _force_head(model, favourite=42, stop_bias=10.0)  # a stop token is the argmax
    assert list(greedy.inference(text, greedy=True)) == [42] * min_len
    m = _force_head(model, favourite=42, stop_bias=-50.0)
    with torch.no_grad():
        m.llm_decoder.bias[V.EOS_INDEX] = 1.0  # eos p=0.73: inside the nucleus with token 42
    lengths = []
    for seed in range(20):
        out = list(m.inference(text, sampling=cfg, generator=torch.Generator().manual_seed(seed)))
        assert set(out) == {42}
        lengths.append(len(out))
    assert min(lengths) == min_len  # refused before min_len, accepted from then on
    assert max(lengths) > min_len


def test_max_length_cap(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=7, stop_bias=-50.0)  # never stops by itself
    text = [3, 4]
    cfg = SamplingConfig(max_token_text_ratio=5)
    out = list(m.inference(text, sampling=cfg, greedy=True))
    assert len(out) == 10 and set(out) == {7}


@pytest.mark.parametrize("stop", V.STOP_INDICES)
def test_every_stop_token_ends(tiny_cosyvoice2, stop):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=9, stop_bias=-50.0)
    with torch.no_grad():
        m.llm_decoder.bias[stop] = 30.0
    cfg = SamplingConfig(min_token_text_ratio=1)
    assert list(m.inference([3], sampling=cfg, greedy=True)) == [9]


def test_only_stop_tokens_raise(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=9, stop_bias=60.0)
    with torch.no_grad():
        m.llm_decoder.bias[9] = -60.0
    with pytest.raises(RuntimeError, match="only stop tokens"):
        list(m.inference([3], sampling=SamplingConfig(max_trials=5), generator=torch.Generator().manual_seed(0)))


def test_nucleus_rule():
    logp = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    # top_p 0.8: 0.5 (mass before 0) and 0.3 (mass before 0.5) kept, 0.15 (0.8 before) not
    seen = {nucleus_sampling(logp, 0.8, 25, g) for _ in range(300)}
    assert seen == {0, 1}
    assert {nucleus_sampling(logp, 1.0, 1, g) for _ in range(50)} == {0}


def test_repetition_aware_resampling():
    logp = torch.tensor([0.9, 0.1] + [1e-9] * 8).log()
    cfg = SamplingConfig(top_k=1)  # nucleus always says 0
    g = torch.Generator().manual_seed(1)
    assert {ras_sampling(logp, [1] * 10, cfg, g) for _ in range(50)} == {0}  # 0 not repeated: kept
    # 0 already in the window once (>= 10 * 0.1): redrawn from the full distribution, so 1 appears
    draws = [ras_sampling(logp, [0] + [1] * 9, cfg, g) for _ in range(300)]
    assert 1 in draws and 0 in draws


def test_loss_targets_speech_and_eos(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    text, speech = [3, 4, 5], [10, 11]
    logits = model.forward_logits(text, speech)
    assert logits.shape == (len(text) + 2 + len(speech), V.NUM_OUTPUTS)
    # positions task_id, s10, s11 predict s10, s11, eos
    want = torch.nn.functional.cross_entropy(logits[-3:], torch.tensor([10, 11, V.EOS_INDEX]))
    assert torch.allclose(model.loss(text, speech), want)
