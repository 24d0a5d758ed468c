"""--reward tanh_reference: the reference recipe's own reward text path (WeTextProcessing
ZhNormalizer with its options, compiled once into TTSRL_CACHE_DIR; lazy_pinyin TONE3 with
sandhi and neutral 5; jiwer WER; 1 - tanh(3c)). With --no-length-guard it is the reference reward."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tn.chinese.normalizer", reason="wetextprocessing is not installed (requirements-cpu.txt)")

from ttsrl.reward.rewards import REWARDS, compute_reward, reference_pinyin_wer  # noqa: E402


def test_reference_normalisation_and_reward():
    # numbers read out and punctuation dropped on both sides, as the reference does
    assert reference_pinyin_wer("我有3个苹果，2024年。", "我有三个苹果二零二四年") == 0.0
    c = reference_pinyin_wer("今天天气很好", "今天天气不好")
    assert c == pytest.approx(1 / 6)
    r = compute_reward("tanh_reference", "今天天气很好", "今天天气不好")  # no n_tokens: no length guard
    assert r.reward == pytest.approx(1 - math.tanh(3 * c)) and r.length_factor == 1.0
    assert reference_pinyin_wer("", "") == 0.0 and reference_pinyin_wer("你好", "") == 1.0
    assert "tanh_reference" in REWARDS
