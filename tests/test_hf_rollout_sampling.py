"""The hf rollout's own draw (ttsrl.verl_plugin.sampling.draw_top_k_top_p): it keeps exactly the
candidates transformers' temperature -> top-k -> top-p warpers keep, with the same probabilities,
its draws follow that distribution, and through a real ``HFRolloutServer`` on the tiny checkpoint
top-k 1 sampling equals greedy decoding while greedy equals transformers' own greedy."""

import pytest
import torch

from ttsrl.verl_plugin.sampling import Sampling, draw_top_k_top_p, top_k_top_p_candidates


def transformers_probs(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution transformers' own warpers give (what generate(do_sample=True) draws from)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)


def our_probs(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits, ids = top_k_top_p_candidates(scores, temperature, top_k, top_p)
    return torch.zeros_like(scores).scatter_(-1, ids, logits.softmax(-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 25, 0.95), (1.0, 25, 1.0), (0.7, -1, 0.9),
                                                     (1.3, 5, 0.5), (1.0, -1, 1.0)])
def test_candidates_and_probabilities_are_those_of_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 700, generator=g) * 3  # peaked and flat rows alike
    want = transformers_probs(scores, temperature, top_k, top_p)
    got = our_probs(scores, temperature, top_k, top_p)
    assert torch.equal(got > 0, want > 0), "a different candidate set"
    # softmax over the same candidates in float32: 700-wide sums in another order (vectorised
    # kernels differ by CPU: AVX2 vs AVX-512) move a probability by a few eps = ~1e-7 at most
    assert torch.allclose(got, want, atol=1e-6)


def test_draws_follow_the_distribution():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 50, generator=g) * 2
    n = 40_000
    draws = draw_top_k_top_p(row.expand(n, -1), 0.8, 10, 0.9, generator=torch.Generator().manual_seed(2))
    freq = torch.bincount(draws, minlength=50).float() / n
    want = transformers_probs(row, 0.8, 10, 0.9)[0]
    assert set(draws.unique().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    # binomial standard error at most sqrt(0.25 / 40000) = 0.0025: 0.012 is about 5 of them
    assert (freq - want).abs().max() < 0.012


def _server(model_dir):
    from omegaconf import OmegaConf

    from ttsrl.verl_plugin.hf_rollout import HFRolloutServer

    rollout = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "hf", "dtype": "float32",
                                "prompt_length": 16, "response_length": 12, "seed": 5})
    model = OmegaConf.create({"path": str(model_dir), "trust_remote_code": True})
    return HFRolloutServer(rollout, model, replica_rank=0)


@pytest.mark.slow  # a server round trip: ~5 s
def test_server_top_k_one_is_greedy_and_greedy_is_transformers_greedy(tiny_hf):
    """The checkpoint's generation_config.json asks for sampling (do_sample, top-k 25, top-p 0.8, as
    CosyVoice2's does): greedy requests must still decode greedily, sampled ones by our draw."""
    server = _server(tiny_hf)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def run(**kw):
        s = Sampling(repetition_penalty=1.0, max_tokens=12, want_logprobs=True, ignore_eos=True, **kw)
        return server._generate_batch(prompts, s)

    greedy = run(temperature=0.0, top_p=1.0, top_k=-1)
    top1 = run(temperature=1.0, top_p=1.0, top_k=1)
    assert [ids for ids, _ in top1] == [ids for ids, _ in greedy]
    with torch.no_grad():
        for p, (ids, logprobs) in zip(prompts, greedy):
            x = torch.tensor([p])
            ref = server.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                        max_new_tokens=12, min_new_tokens=12, eos_token_id=None, pad_token_id=0)
            assert ids == ref[0, len(p):].tolist()
            assert len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)
    sampled = run(temperature=1.0, top_p=1.0, top_k=-1)
    assert [ids for ids, _ in sampled] != [ids for ids, _ in greedy]


@pytest.mark.slow  # 3 x 40,000 draws over 6,664 scores: 15-22 s on a 2-core AMD EPYC
def test_rule_draws_follow_the_rule_distribution_of_each_row_window():
    """RuleDraw.draw samples cosyvoice_lm.rule_distribution (the closed form of pick_token, which the vLLM path
    draws from) for each row's last win_size generated codes; ids that are no output (the padding after a
    finished row's stop) count for nothing in the window."""
    from ttsrl.families import family
    from ttsrl.model.cosyvoice_lm import SamplingConfig, rule_distribution
    from ttsrl.verl_plugin.sampling import RuleDraw

    fam = family("cosyvoice2")
    offset, pad = 100, 7  # a text vocabulary of 100 ids; pad is a text id
    cfg = SamplingConfig(rule="cosyvoice2-2026", min_token_text_ratio=0.0, top_p=0.8, top_k=25)
    draw = RuleDraw(cfg, offset, fam.num_outputs, fam.eos_index)
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, offset + fam.num_outputs, generator=g) * 4
    generated = torch.tensor([[offset + 5, offset + 9, offset + 5, offset + 1] + [offset + 2] * 9,
                              [offset + 5] * 13,
                              [offset + 3, offset + fam.eos_index] + [pad] * 11])
    # the rows' likely picks must be in their windows for the redraw to matter
    top = scores[:, offset:].argmax(-1)
    generated[0, -1], generated[1, -1] = offset + top[0], offset + top[1]
    n = 40_000
    for b in range(3):
        window = [int(t) - offset for t in generated[b, -10:] if offset <= int(t) < offset + fam.num_outputs]
        want = rule_distribution(scores[b, offset:].float().log_softmax(-1), window, True, cfg)
        if b < 2:
            assert want[top[b]] < 1e-3  # a blocked pick (a redraw may still land there)
        picks = draw.draw(scores[b:b + 1].expand(n, -1), generated[b:b + 1].expand(n, -1), 0.8, 25,
                          generator=torch.Generator().manual_seed(b))
        freq = torch.bincount(picks, minlength=fam.num_outputs).double() / n
        assert set(picks.unique().tolist()) <= set(torch.nonzero(want).flatten().tolist())
        # binomial standard error at most sqrt(0.25 / 40000) = 0.0025: 0.012 is about 5 of them
        assert (freq - want).abs().max() < 0.012, b


def test_rollouts_by_the_rule_block_a_repeated_pick(tiny_hf):
    """Through a real HFRolloutServer on the tiny checkpoint with ``custom.sampling_rule``: at top-k 1
    CosyVoice's rule is deterministic where the argmax is new (it is the token) and excludes the argmax
    where it is already in the last 10 generated codes (blocked, redrawn from the rest); the tiny model's
    greedy output repeats, so both cases occur. The log-probs returned are the policy's."""
    from omegaconf import OmegaConf

    from ttsrl.verl_plugin.hf_rollout import HFRolloutServer

    rollout = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "hf", "dtype": "float32",
                                "prompt_length": 16, "response_length": 24, "seed": 5,
                                "custom": {"sampling_rule": "cosyvoice2-2026"}})
    server = HFRolloutServer(rollout, OmegaConf.create({"path": str(tiny_hf), "trust_remote_code": True}), 0)
    offset = server.rule_draw.speech_offset
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    s = Sampling(temperature=1.0, top_p=1.0, top_k=1, repetition_penalty=1.0, max_tokens=24, want_logprobs=True,
                 ignore_eos=True)
    blocked = 0
    with torch.no_grad():
        for p, (ids, logprobs) in zip(prompts, server._generate_batch(prompts, s)):
            assert len(ids) == 24
            x = torch.tensor([p + ids])
            logits = server.model(input_ids=x).logits[0, len(p) - 1:-1].float()
            assert torch.allclose(torch.tensor(logprobs), logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0],
                                  atol=1e-4)
            for j, t in enumerate(ids):
                top = offset + int(logits[j, offset:offset + server.rule_draw.num_outputs].argmax())
                if top in ids[max(0, j - 10):j]:
                    assert t != top
                    blocked += 1
                else:
                    assert t == top
    assert blocked > 0
