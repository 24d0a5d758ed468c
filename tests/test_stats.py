"""Bootstrap intervals (ttsrl.stats): a planted 2-point drop is detected, no drop is not."""

import numpy as np
import pytest

from ttsrl.stats import UttTable, bootstrap, bootstrap_mean, figure, paired, paired_mean, seed_spread

N, REF = 300, 20  # 300 utterances of 20 characters: one error = 5 points of that utterance


def table(errors, ids=None):
    errors = np.asarray(errors, dtype=float)
    ids = ids or [f"u{i}" for i in range(len(errors))]
    return UttTable(tuple(ids), errors / REF, errors, np.full(len(errors), float(REF)))


@pytest.fixture(scope="module")
def base_errors():
    return np.random.default_rng(7).binomial(REF, 0.10, size=N)


def moved(base, better: int, worse: int, seed: int):
    """``better`` utterances lose one error, ``worse`` others gain one."""
    rng = np.random.default_rng(seed)
    e = base.copy()
    can_improve = np.flatnonzero(e >= 1)
    up = rng.choice(can_improve, size=better, replace=False)
    rest = np.setdiff1d(np.arange(N), up)
    down = rng.choice(rest, size=worse, replace=False)
    e[up] -= 1
    e[down] += 1
    return e


def test_paired_bootstrap_detects_a_planted_two_point_drop(base_errors):
    # 200 utterances one error better, 80 one error worse: net -120 errors of 6000 = -2 points
    model = moved(base_errors, 200, 80, seed=1)
    b, m = table(base_errors), table(model)
    for metric in ("cer_utt_mean", "cer_pooled"):
        r = paired(m, b, metric, resamples=2000, seed=0)
        assert r["diff"] == pytest.approx(-0.02)
        assert r["hi"] < 0, r  # the interval of the drop excludes 0
        assert -0.03 < r["lo"] < r["diff"] < r["hi"] < -0.01
        assert r["p_better"] > 0.99 and r["n"] == N


def test_paired_bootstrap_sees_no_drop_between_identical_checkpoints(base_errors):
    b = table(base_errors)
    same = table(base_errors[::-1], ids=[f"u{i}" for i in range(N)][::-1])  # other order: paired by id
    r = paired(same, b, "cer_utt_mean")
    assert (r["diff"], r["lo"], r["hi"], r["p_better"]) == (0.0, 0.0, 0.0, 0.0)


def test_paired_bootstrap_sees_no_drop_in_pure_noise(base_errors):
    # 100 better and 100 worse by one error: same total, the interval straddles 0
    noisy = table(moved(base_errors, 100, 100, seed=2))
    r = paired(noisy, table(base_errors), "cer_utt_mean", seed=3)
    assert r["diff"] == pytest.approx(0.0)
    assert r["lo"] < 0 < r["hi"]
    assert 0.2 < r["p_better"] < 0.8


def test_bootstrap_interval_brackets_the_figure_and_is_seeded(base_errors):
    t = table(base_errors)
    lo, hi = bootstrap(t, "cer_utt_mean", seed=0)
    assert lo < figure(t, "cer_utt_mean") < hi
    # the sd of a binomial(20, .1)/20 rate is 0.067; over 300 utterances the 95% interval is
    # about +-1.96 * 0.067 / sqrt(300) = +-0.0076 wide on each side
    assert 0.010 < hi - lo < 0.020
    assert bootstrap(t, "cer_utt_mean", seed=0) == (lo, hi)
    with pytest.raises(ValueError, match="metric"):
        bootstrap(t, "wer", seed=0)


def test_rows_with_several_seeds_enter_as_one_utterance():
    rows = [{"id": "a", "utt_rate": 0.5, "cer_errors": 1, "ref_len": 2},
            {"id": "b", "utt_rate": 0.0, "cer_errors": 0, "ref_len": 4},
            {"id": "a", "utt_rate": 1.0, "cer_errors": 2, "ref_len": 2}]
    t = UttTable.from_rows(rows)
    assert t.ids == ("a", "b") and t.rate.tolist() == [0.75, 0.0]
    assert figure(t, "cer_utt_mean") == pytest.approx(0.375)
    assert figure(t, "cer_pooled") == pytest.approx(3 / 8)  # errors and lengths summed over seeds
    s = seed_spread([0.30, 0.34, 0.32])
    assert s["mean"] == pytest.approx(0.32) and s["std"] == pytest.approx(0.02)
    assert (s["min"], s["max"]) == (0.30, 0.34)


def test_paired_mean_on_shared_utterances_by_hand():
    d = paired_mean({"a": 0.5, "b": 0.7, "x": 0.9}, {"a": 0.6, "b": 0.8, "c": 0.1}, resamples=200)
    # only a and b are shared; each differs by -0.1, so every resample does too
    assert d["n"] == 2 and d["diff"] == pytest.approx(-0.1)
    assert (d["lo"], d["hi"]) == (pytest.approx(-0.1), pytest.approx(-0.1))
    assert paired_mean({"a": 0.5}, {"b": 0.5}) is None
    lo, hi = bootstrap_mean([0.2, 0.4, 0.9], resamples=500)
    assert 0.2 <= lo < 0.5 < hi <= 0.9
