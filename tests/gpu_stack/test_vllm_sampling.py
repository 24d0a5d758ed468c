"""CosyVoice2's sampling rule inside a real vLLM 0.24 engine (ttsrl/model/vllm_sampling.py).

The tiny random checkpoint gets a speech head that makes the rule matter: three strong
speech rows, eos and the fill token (6563) among the likely ones. Hundreds of seeded
requests for one prompt are drawn through vLLM; the frequencies of their first
``STEPS`` tokens must fit the rule's distribution computed from the transformers class's
own logits (``rule_distribution``, chi-square of tests/draws.py), for both rules, with
the minimum length inside those steps.
"""

from __future__ import annotations

import pytest
import torch
from draws import assert_fits

from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import SamplingConfig, rule_distribution

RULE_2026, RULE_2024 = "cosyvoice2-2026", "cosyvoice2-2024"  # CosyVoice2's rules (the tiny model's family)

TEXTS = ["今天天气很好", "银行的行长在行走", "Hello world",
         "二零二四年三月五日", "重庆的重量很重要", "你好"]
TINY = dict(num_attention_heads=1, num_key_value_heads=1)  # head_dim 64: vLLM's CPU attention has kernels for it
HEAD_BIAS = {100: 10.0, 200: 9.5, 300: 9.0, V.family("cosyvoice2").eos_index: 9.5, V.family("cosyvoice2").stop_indices[2]: 8.5}
STEPS, MIN_LEN, N = 3, 2, 600  # tokens looked at, minimum length, requests per rule
FLOOR = 1e-4  # outcomes below this step probability are left to the pooled cell


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """(dir, SpeechLM): a converted tiny checkpoint with the head biases of HEAD_BIAS."""
    from ttsrl.atomic import atomic_torch_save
    from ttsrl.embedded.tiny_model import TinyConfig, make_tiny_cosyvoice2
    from ttsrl.model.convert import cosyvoice_to_hf
    from ttsrl.model.hf_model import load_speech_lm

    d = tmp_path_factory.mktemp("vllm_rule")
    model = make_tiny_cosyvoice2(d / "cv", TEXTS * 8, TinyConfig(**TINY))
    with torch.no_grad():
        for index, bias in HEAD_BIAS.items():
            model.llm_decoder.bias[index] = bias
    atomic_torch_save(model.state_dict(), d / "cv" / "llm.pt")
    cosyvoice_to_hf(d / "cv", d / "hf", log=lambda _: None)
    return d / "hf", load_speech_lm(d / "hf")


@pytest.fixture(scope="module")
def engine(shaped):
    from ttsrl.model.generate import VLLMGenerator

    path, lm = shaped
    gen = VLLMGenerator(str(path), lm.vocab, seed=0, dtype="float32", enforce_eager=True,
                        gpu_memory_utilization=0.3, max_model_len=256)
    yield gen
    gen.close()


def _requests(tokenizer):
    from ttsrl.model.generate import Request

    return [Request(key=f"u{i}", text_ids=tuple(tokenizer.encode(t, add_special_tokens=False)))
            for i, t in enumerate(TEXTS)]


def _outcome(out, vocab: V.SpeechVocab) -> tuple[int, ...]:
    """A request's output indices, its stop token included."""
    toks = list(out.token_ids)
    if out.finish_reason == "stop" and isinstance(out.stop_reason, int) and toks[-1:] != [out.stop_reason]:
        toks.append(out.stop_reason)
    return tuple(vocab.to_index(t) for t in toks)


def _draw(gen, lm, ids: list[int], cfg: SamplingConfig) -> list[tuple[int, ...]]:
    from ttsrl.model.vllm_sampling import rule_sampling_params

    params = [rule_sampling_params(cfg, MIN_LEN, STEPS, False, lm.vocab.stop_ids, seed=1000 + i) for i in range(N)]
    outs = gen.llm.generate([{"prompt_token_ids": ids}] * N, params, use_tqdm=False)
    return [_outcome(o.outputs[0], lm.vocab) for o in outs]


@torch.no_grad()
def _expected(lm, ids: list[int], cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first STEPS outputs) under the rule, from the transformers class's logits; a stop
    ends an outcome. Each step is conditioned on pick_token not raising (as vLLM draws)."""
    start, end = lm.vocab.output_range
    want: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        seq = torch.tensor([ids + [lm.vocab.to_hf(i) for i in prefix]])
        logp = lm.model(seq).logits[0, -1, start:end].float().log_softmax(dim=-1)
        dist = rule_distribution(logp, prefix, len(prefix) >= MIN_LEN, cfg)
        dist = dist / dist.sum()
        for x in torch.nonzero(dist > FLOOR).flatten().tolist():
            out, m = prefix + (x,), mass * float(dist[x])
            if x >= V.family("cosyvoice2").speech_token_size or len(out) == STEPS:
                want[out] = m
            else:
                walk(out, m)

    walk((), 1.0)
    return want


def test_vllm_draws_follow_the_rule(engine, shaped):
    """vLLM's draws fit each rule's distribution, and not the other rule's; the rules'
    marks are in them: 2026 never draws eos before the minimum length but ends on the fill
    token, and never repeats the first token at step 2 (its only window entry); 2024
    draws no stop index before the minimum length and does repeat."""
    from ttsrl.model.generate import build_input_ids

    _, lm = shaped
    ids = build_input_ids(lm.vocab, _requests(lm.tokenizer)[0])
    draws, want = {}, {}
    for rule in (RULE_2026, RULE_2024):
        cfg = SamplingConfig(rule=rule)
        draws[rule], want[rule] = _draw(engine, lm, ids, cfg), _expected(lm, ids, cfg)
        assert_fits(draws[rule], want[rule], f"vLLM {rule}, first {STEPS} tokens", complete=False)
    early = [d[:MIN_LEN] for d in draws[RULE_2026]]
    assert not any(V.family("cosyvoice2").eos_index in e for e in early)
    assert any(V.family("cosyvoice2").stop_indices[2] in e for e in early)
    assert all(d[0] != d[1] for d in draws[RULE_2026] if len(d) > 1)
    assert not any(i >= V.family("cosyvoice2").speech_token_size for d in draws[RULE_2024] for i in d[:MIN_LEN])
    assert any(d[0] == d[1] for d in draws[RULE_2024] if len(d) > 1)
    with pytest.raises(AssertionError, match="(do not fit|excludes)"):  # the fit has the power to tell
        assert_fits(draws[RULE_2026], want[RULE_2024], "2026 draws against 2024", complete=False)


def test_generate_samples_within_the_length_limits(engine, shaped):
    """Stage 4's call: VLLMGenerator.generate with sampling gives speech codes within
    [min_len, max_len] (rule 2026 may end earlier on the fill token), the same again for
    the same seed; greedy equals the transformers engine under both rules."""
    from ttsrl.model.generate import GenerationConfig, HFGenerator, length_limits

    _, lm = shaped
    reqs = _requests(lm.tokenizer)
    hf = HFGenerator(lm.model, lm.vocab)
    for rule in (RULE_2026, RULE_2024):
        sampling = SamplingConfig(rule=rule, max_token_text_ratio=6.0)
        cfg = GenerationConfig(greedy=False, sampling=sampling, seed=3)
        out = engine.generate(reqs, cfg)
        assert [g.codes for g in engine.generate(reqs, cfg)] == [g.codes for g in out]
        for r, g in zip(reqs, out):
            lo, hi = length_limits(len(r.text_ids), sampling)
            assert g.error is None and all(0 <= c < V.family("cosyvoice2").speech_token_size for c in g.codes), g
            assert len(g.codes) <= hi and (g.stopped or len(g.codes) == hi), (r.key, len(g.codes), lo, hi)
            assert rule == RULE_2026 or len(g.codes) >= lo, (r.key, len(g.codes), lo)
        print(f"[{rule}] sampled lengths {[len(g.codes) for g in out]}")
        greedy = GenerationConfig(greedy=True, sampling=sampling)
        assert [g.codes for g in engine.generate(reqs, greedy)] == [g.codes for g in hf.generate(reqs, greedy)]


def test_non_neutral_sampler_settings_are_refused(engine, shaped):
    """A rule request whose vLLM settings would reshape the rule's distribution is refused."""
    from vllm import SamplingParams

    from ttsrl.model.vllm_sampling import rule_args

    _, lm = shaped
    ids = [{"prompt_token_ids": [lm.vocab.sos_id, lm.vocab.task_id]}]
    for bad in (dict(temperature=0.8), dict(top_k=25), dict(min_tokens=2)):
        sp = SamplingParams(**{"temperature": 1.0, **bad}, max_tokens=2,
                            extra_args=rule_args(SamplingConfig(), 0, greedy=False))
        with pytest.raises(ValueError, match="neutral"):
            engine.llm.generate(ids, sp, use_tqdm=False)


def test_processor_rows_follow_the_batch():
    """The processor alone (no engine): each row of a batch gets log rule_distribution of
    its own request (window = its live output list, its rule and minimum length), greedy
    rows only their held stop rows, other requests nothing; rows follow vLLM's swaps and
    removals, and tokens appended to the live lists."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from ttsrl.model.vllm_sampling import CosyVoiceRuleProcessor, rule_sampling_params

    vocab = V.SpeechVocab(1000, V.family("cosyvoice2"))
    start, end = vocab.output_range
    hf_config = SimpleNamespace(speech_output_range=list(vocab.output_range), speech_family="cosyvoice2")
    proc = CosyVoiceRuleProcessor(SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config)),
                                  torch.device("cpu"), False)
    rules = [SamplingConfig(), SamplingConfig(rule=RULE_2024), SamplingConfig(), None]
    min_lens, greedy = [2, 5, 2, 0], [False, False, True, False]
    outs = [[vocab.to_hf(5)] * 3, [vocab.to_hf(7), vocab.to_hf(5)], [], []]
    params = [rule_sampling_params(r, m, 10, g, vocab.stop_ids, seed=1) if r else SamplingParams(temperature=1.0)
              for r, m, g in zip(rules, min_lens, greedy)]
    proc.update_state(BatchUpdate(batch_size=4, removed=[], moved=[],
                                  added=[(i, p, None, o) for i, (p, o) in enumerate(zip(params, outs))]))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab.padded_vocab_size, generator=g) * 3

    def check(got: torch.Tensor, row: int, req: int) -> None:
        if rules[req] is None:
            assert torch.equal(got[row], logits[row])
        elif greedy[req]:
            held = [vocab.eos_id] if len(outs[req]) < min_lens[req] else []
            want = logits[row].clone()
            want[held] = -float("inf")
            assert torch.equal(got[row], want)
        else:
            codes = [vocab.to_index(t) for t in outs[req]]
            dist = rule_distribution(logits[row, start:end].log_softmax(-1), codes,
                                     len(codes) >= min_lens[req], rules[req])
            p = got[row].softmax(-1)
            assert float(p[:start].sum() + p[end:].sum()) == 0.0
            # the processor's float32 softmax vs the rule's float64 closed form over the same
            # logits: rounding of a 6,561-wide normalisation, ~1e-7 at most on a probability
            assert torch.allclose(p[start:end].double(), dist / dist.sum(), atol=1e-6)

    got = proc.apply(logits.clone())
    for row in range(4):
        check(got, row, row)
    # vLLM swaps rows 0 and 1, drops row 3; request 0 and the greedy one generate a token
    proc.update_state(BatchUpdate(batch_size=3, removed=[3], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    outs[0].append(vocab.to_hf(9))
    outs[2].extend([vocab.to_hf(1), vocab.to_hf(2)])  # reaches its minimum length: nothing held
    logits = torch.randn(3, vocab.padded_vocab_size, generator=g) * 3
    got = proc.apply(logits.clone())
    for row, req in ((0, 1), (1, 0), (2, 2)):
        check(got, row, req)
