"""Qwen2LM (the CosyVoice2 reference implementation): loss layout and sampling rules."""

import pytest
import torch
from draws import assert_fits

from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import (
    SamplingConfig,
    SamplingError,
    nucleus_sampling,
    pick_token,
    ras_sampling,
    rule_distribution,
)

RULE_2026, RULE_2024 = "cosyvoice2-2026", "cosyvoice2-2024"  # CosyVoice2's rules (Qwen2LM's family)


def _force_head(model, favourite: int, stop_bias: float):
    """A copy of the model whose head always prefers ``favourite`` and gives the stop
    tokens ``stop_bias``."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.llm_decoder.weight.zero_()
        m.llm_decoder.bias.fill_(-20.0)
        m.llm_decoder.bias[favourite] = 0.0
        m.llm_decoder.bias[V.family("cosyvoice2").speech_token_size:] = stop_bias
    return m


@pytest.mark.parametrize("rule", [RULE_2026, RULE_2024])
def test_min_length_then_stop(tiny_cosyvoice2, rule):
    _, model = tiny_cosyvoice2
    text = [3, 4, 5]
    cfg = SamplingConfig(rule=rule, tau_r=2.0)  # RAS off (threshold 20 > window 10): length rules only
    min_len = int(len(text) * cfg.min_token_text_ratio)
    greedy = _force_head(model, favourite=42, stop_bias=-50.0)
    with torch.no_grad():
        greedy.llm_decoder.bias[V.family("cosyvoice2").eos_index] = 10.0  # eos is the argmax
    assert list(greedy.inference(text, greedy=True, sampling=cfg)) == [42] * min_len
    m = _force_head(model, favourite=42, stop_bias=-50.0)
    with torch.no_grad():
        m.llm_decoder.bias[V.family("cosyvoice2").eos_index] = 1.0  # eos p=0.73: inside the nucleus with token 42
    lengths = []
    for seed in range(20):
        out = list(m.inference(text, sampling=cfg, generator=torch.Generator().manual_seed(seed)))
        assert set(out) == {42}
        lengths.append(len(out))
    assert min(lengths) == min_len  # refused before min_len, accepted from then on
    assert max(lengths) > min_len


def test_today_only_eos_row_is_held_before_min_length(tiny_cosyvoice2):
    """CosyVoice's sampling_ids (commit 0e62489) sets only row speech_token_size (6561)
    to -inf before the minimum length: the fill token 6563 can still be drawn, and
    Qwen2LM.inference then stops. The 2024 rule rejected every stop index."""
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=42, stop_bias=-50.0)
    with torch.no_grad():
        m.llm_decoder.bias[V.family("cosyvoice2").stop_indices[2]] = 10.0
    assert list(m.inference([3, 4], greedy=True, sampling=SamplingConfig(rule=RULE_2026))) == []
    assert list(m.inference([3, 4], greedy=True, sampling=SamplingConfig(rule=RULE_2024))) == [42] * 4
def test_max_length_cap(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=7, stop_bias=-50.0)  # never stops by itself
    text = [3, 4]
    cfg = SamplingConfig(max_token_text_ratio=5)
    out = list(m.inference(text, sampling=cfg, greedy=True))
    assert len(out) == 10 and set(out) == {7}


@pytest.mark.parametrize("rule", [RULE_2026, RULE_2024])
@pytest.mark.parametrize("stop", V.family("cosyvoice2").stop_indices)
def test_every_stop_token_ends(tiny_cosyvoice2, stop, rule):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=9, stop_bias=-50.0)
    with torch.no_grad():
        m.llm_decoder.bias[stop] = 30.0
    cfg = SamplingConfig(min_token_text_ratio=1, rule=rule)
    # today's rule holds back only eos (6561) before min_len; eos2/eos3 end at once
    want = [] if rule == RULE_2026 and stop != V.family("cosyvoice2").eos_index else [9]
    assert list(m.inference([3], sampling=cfg, greedy=True)) == want


def test_only_stop_tokens(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    m = _force_head(model, favourite=9, stop_bias=-60.0)
    with torch.no_grad():
        m.llm_decoder.bias[9] = -60.0
        m.llm_decoder.bias[V.family("cosyvoice2").eos_index] = 60.0  # eos takes all the mass
    g = torch.Generator().manual_seed(0)
    # 2024: redraws max_trials times, then gives up
    with pytest.raises(SamplingError, match="only stop tokens"):
        list(m.inference([3], sampling=SamplingConfig(max_trials=5, rule=RULE_2024), generator=g))
    # today: eos row at -inf, one draw from what is left, no error
    out = list(m.inference([3], sampling=SamplingConfig(rule=RULE_2026), generator=g))
    assert len(out) == 2 and all(0 <= c < V.family("cosyvoice2").speech_token_size for c in out)


def test_unknown_rule_refused():
    with pytest.raises(ValueError, match="unknown sampling rule"):
        SamplingConfig(rule="cosyvoice2")


def test_nucleus_rule():
    logp = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    # top_p 0.8: 0.5 (mass before 0) and 0.3 (mass before 0.5) kept, 0.15 (0.8 before) not
    seen = {nucleus_sampling(logp, 0.8, 25, g) for _ in range(300)}
    assert seen == {0, 1}
    assert {nucleus_sampling(logp, 1.0, 1, g) for _ in range(50)} == {0}


@pytest.mark.parametrize("rule", [RULE_2026, RULE_2024])
def test_repetition_aware_resampling(rule):
    logp = torch.tensor([0.9, 0.1] + [1e-9] * 8).log()
    cfg = SamplingConfig(top_k=1, rule=rule)  # nucleus always says 0
    g = torch.Generator().manual_seed(1)
    assert {ras_sampling(logp.clone(), [1] * 10, cfg, g) for _ in range(50)} == {0}  # 0 not repeated: kept
    # 0 already in the window once (>= 10 * 0.1): redrawn from the full distribution;
    # today's rule (commit f2ddcbe) blocks 0 in that redraw, the 2024 rule does not
    draws = [ras_sampling(logp.clone(), [0] + [1] * 9, cfg, g) for _ in range(300)]
    assert 1 in draws
    assert (0 in draws) == (rule == RULE_2024)


def _logp(probs: dict[int, float]) -> torch.Tensor:
    """Log-probs over the 6564 outputs with the given mass on a few rows (the rest ~0)."""
    p = torch.full((V.family("cosyvoice2").num_outputs,), 1e-12, dtype=torch.float64)
    for k, v in probs.items():
        p[k] = v
    return (p / p.sum()).log().float()


def _nucleus_of(p: dict[int, float], cfg: SamplingConfig) -> list[int]:
    order = sorted(p, key=lambda k: -p[k])
    nucleus, before = [], 0.0
    for k in order:
        if before < cfg.top_p and len(nucleus) < cfg.top_k:
            nucleus.append(k)
            before += p[k]
    return nucleus


def _expected_2026(probs: dict[int, float], window: list[int], cfg: SamplingConfig, allow_stop: bool):
    """Exact next-token distribution of CosyVoice's current rule (sampling_ids +
    ras_sampling at commits 0e62489 / f2ddcbe) over the few rows with mass."""
    p = dict(probs)
    if not allow_stop:
        p.pop(V.family("cosyvoice2").eos_index, None)
    total = sum(p.values())
    p = {k: v / total for k, v in p.items()}
    nucleus = _nucleus_of(p, cfg)
    in_nucleus = sum(p[k] for k in nucleus)
    want = {k: 0.0 for k in p}
    for t in nucleus:
        q = p[t] / in_nucleus
        if window[-cfg.win_size:].count(t) >= cfg.win_size * cfg.tau_r:
            for j in p:  # redraw with t blocked, and eos still blocked
                if j != t:
                    want[j] += q * p[j] / (1 - p[t])
        else:
            want[t] += q
    return want


@pytest.mark.parametrize("allow_stop", [False, True])
def test_pick_token_matches_cosyvoice_today_exactly(allow_stop):
    """Draw frequencies of pick_token against the exact distribution of CosyVoice's
    current rule, including both -inf writes acting on the same step's scores: before
    the minimum length the eos row stays blocked in the repetition redraw too."""
    probs = {5: 0.35, 7: 0.2, V.family("cosyvoice2").eos_index: 0.3, 11: 0.1, V.family("cosyvoice2").stop_indices[1]: 0.05}
    cfg = SamplingConfig(top_k=3)
    window = [5, 1, 2, 3, 4, 6, 8, 9, 10, 12]  # 5 is in the window: repeated (>= 1)
    logp = _logp(probs)
    before = logp.clone()
    g = torch.Generator().manual_seed(3)
    n = 6000
    got: dict[int, int] = {}
    for _ in range(n):
        k = pick_token(logp, window, allow_stop, cfg, generator=g)
        got[k] = got.get(k, 0) + 1
    assert torch.equal(logp, before)  # the caller's scores are untouched
    want = _expected_2026(probs, window, cfg, allow_stop)
    assert set(got) <= {k for k, v in want.items() if v > 0}, (got, want)
    for k, v in want.items():
        assert abs(got.get(k, 0) / n - v) < 0.025, (k, got, want)
    if not allow_stop:
        assert V.family("cosyvoice2").eos_index not in got and 5 not in got


def _expected_2024(probs: dict[int, float], window: list[int], cfg: SamplingConfig, allow_stop: bool):
    """Exact distribution of the 2024 rule over the few rows with mass, SamplingError as
    the key "error": one draw is the nucleus pick, or (repeated pick) a draw from the full
    distribution; before the minimum length a stop index repeats the draw, at most
    max_trials draws."""
    total = sum(probs.values())
    p = {k: v / total for k, v in probs.items()}
    nucleus = _nucleus_of(p, cfg)
    in_nucleus = sum(p[k] for k in nucleus)
    draw = {k: 0.0 for k in p}
    for t in nucleus:
        q = p[t] / in_nucleus
        if window[-cfg.win_size:].count(t) >= cfg.win_size * cfg.tau_r:
            for j in p:  # redraw, t not blocked
                draw[j] += q * p[j]
        else:
            draw[t] += q
    if allow_stop:
        return {**draw, "error": 0.0}
    stop = sum(v for k, v in draw.items() if k >= V.family("cosyvoice2").speech_token_size)
    want: dict = {k: 0.0 for k in p}
    for trial in range(cfg.max_trials):  # this draw is the first one without a stop index
        for k, v in draw.items():
            if k < V.family("cosyvoice2").speech_token_size:
                want[k] += stop ** trial * v
    return {**want, "error": stop ** cfg.max_trials}


EXPECTED = {RULE_2026: lambda *a: {**_expected_2026(*a), "error": 0.0}, RULE_2024: _expected_2024}
# (probs, window), top_k 3. one-repeated: the repeated pick 5 is the nucleus's largest
# entry, eos is in the nucleus; two-repeated: nucleus {5, 7, 6563} before and after the
# minimum length, 5 and 7 repeated (the window's first entry is outside the last 10)
RULE_CASES = {
    "one-repeated": ({5: 0.35, 7: 0.2, V.family("cosyvoice2").eos_index: 0.3, 11: 0.1, V.family("cosyvoice2").stop_indices[1]: 0.05},
                     [5, 1, 2, 3, 4, 6, 8, 9, 10, 12]),
    "two-repeated": ({5: 0.3, 7: 0.25, V.family("cosyvoice2").stop_indices[2]: 0.2, V.family("cosyvoice2").eos_index: 0.15, 11: 0.1},
                     [11, 7, 41, 42, 5, 43, 44, 45, 46, 47, 48]),
}
RULE_CFG = {RULE_2026: SamplingConfig(top_k=3), RULE_2024: SamplingConfig(top_k=3, rule=RULE_2024, max_trials=3)}


def _as_dict(dist: torch.Tensor) -> dict:
    """A step distribution as {index: probability} over its support, plus "error": the
    mass it lacks (the probability that pick_token raises)."""
    support = {int(k): float(dist[k]) for k in torch.nonzero(dist > 0).flatten()}
    return {**support, "error": max(0.0, 1.0 - float(dist.sum()))}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("allow_stop", [False, True])
@pytest.mark.parametrize("rule", [RULE_2026, RULE_2024])
def test_rule_distribution_is_the_rule_written_out(rule, allow_stop, case):
    """rule_distribution (the closed form vLLM samples from) against the rule computed
    by hand, row by row, for the few rows with mass; the 1e-12 floor of _logp elsewhere."""
    probs, window = RULE_CASES[case]
    cfg = RULE_CFG[rule]
    got = rule_distribution(_logp(probs), window, allow_stop, cfg)
    want = EXPECTED[rule](probs, window, cfg, allow_stop)
    # 1e-6 absolute on probabilities: rule_distribution works in float32 (eps 1.2e-7) from
    # log-probs, the expected values in float64; a few exp/normalise steps of rounding, nothing
    # kernel-dependent (elementwise ops, no reduction long enough to reorder)
    for k, v in want.items():
        if k != "error":
            assert float(got[k]) == pytest.approx(v, abs=1e-6), (k, float(got[k]), v)
    assert 1.0 - float(got.sum()) == pytest.approx(want["error"], abs=1e-6)
    if rule == RULE_2024 and not allow_stop:
        assert want["error"] > 0.01  # max_trials 3: the cut-off really matters here


@pytest.mark.parametrize("case", sorted(RULE_CASES))
@pytest.mark.parametrize("allow_stop", [False, True])
@pytest.mark.parametrize("rule", [RULE_2026, RULE_2024])
def test_rule_distribution_matches_pick_token_draws(rule, allow_stop, case):
    """Draws of pick_token fit rule_distribution (chi-square), SamplingError included as
    an outcome of its own: before and after the minimum length, repeated picks inside
    the nucleus."""
    probs, window = RULE_CASES[case]
    cfg = RULE_CFG[rule]
    logp = _logp(probs)
    g = torch.Generator().manual_seed(11)
    draws = []
    for _ in range(2000):
        try:
            draws.append(pick_token(logp, window, allow_stop, cfg, generator=g))
        except SamplingError:
            draws.append("error")
    assert_fits(draws, _as_dict(rule_distribution(logp, window, allow_stop, cfg)), f"{rule} {case} {allow_stop}")


def test_rule_distribution_redraw_after_a_near_certain_pick():
    """A repeated pick with p = 1 - 1e-9: the redraw spreads over what is left, whose
    mass 1 - p(t) is summed from the other rows (1 - p(t) in floats would lose it)."""
    logp = torch.full((V.family("cosyvoice2").num_outputs,), -30.0)
    logp[5], logp[9] = 0.0, -21.0  # 9 holds ~0.75 of the rest
    logp = logp.log_softmax(dim=-1)
    cfg = SamplingConfig()
    got = rule_distribution(logp, [5], True, cfg)
    assert float(got[5]) == 0.0 and float(got.sum()) == pytest.approx(1.0, abs=1e-9)
    rest = logp.double().exp()
    rest[5] = 0
    assert torch.allclose(got, rest / rest.sum(), rtol=1e-6, atol=0)  # float32 from float64: ~8 eps
    g = torch.Generator().manual_seed(2)
    assert_fits([pick_token(logp, [5], True, cfg, generator=g) for _ in range(500)], _as_dict(got), "near-certain")


def test_the_fit_tells_the_rules_apart():
    """The chi-square check has the power to see the rules' difference: draws made from
    the 2024 distribution do not fit the 2026 one (same probs and window)."""
    probs, window = RULE_CASES["one-repeated"]
    logp = _logp(probs)
    d2024 = rule_distribution(logp, window, True, RULE_CFG[RULE_2024])
    d2026 = rule_distribution(logp, window, True, RULE_CFG[RULE_2026])
    draws = torch.multinomial(d2024.float(), 2000, replacement=True, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="(do not fit|excludes)"):
        assert_fits(draws.tolist(), _as_dict(d2026), "2024 draws against 2026")


def test_loss_targets_speech_and_eos(tiny_cosyvoice2):
    _, model = tiny_cosyvoice2
    text, speech = [3, 4, 5], [10, 11]
    logits = model.forward_logits(text, speech)
    assert logits.shape == (len(text) + 2 + len(speech), V.family("cosyvoice2").num_outputs)
    # positions task_id, s10, s11 predict s10, s11, eos
    want = torch.nn.functional.cross_entropy(logits[-3:], torch.tensor([10, 11, V.family("cosyvoice2").eos_index]))
    assert torch.allclose(model.loss(text, speech), want)  # same logits, same reduction: rounding only
