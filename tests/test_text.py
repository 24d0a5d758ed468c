"""Mandarin normalisation, pinyin, error rates (ttsrl.text) and reward variants (ttsrl.reward.rewards)."""

import json
import math
from pathlib import Path

import pytest

from ttsrl.reward import rewards
from ttsrl.reward.rewards import REWARDS, RewardResult, compute_reward, expected_tokens
from ttsrl.text import cer, error_counts, is_pinyin_transcript, normalize, pinyin, pinyin_error_rate

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus"


def corpus_texts():
    return [json.loads(line)["text"]
            for name in ("train.jsonl", "test.jsonl")
            for line in (CORPUS / name).read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- normalize

@pytest.mark.parametrize("raw, expected", [
    ("今天是2024年3月5日。", "今天是二零二四年三月五日"),
    ("2024-03-05", "二零二四年三月五日"),
    ("价格上涨了50%", "价格上涨了百分之五十"),
    ("增长率是7.5%", "增长率是百分之七点五"),
    ("圆周率约等于3.14", "圆周率约等于三点一四"),
    ("他的电话是13812345678", "他的电话是一三八一二三四五六七八"),
    ("请拨打010-12345678", "请拨打零一零一二三四五六七八"),
    ("会议在10:30开始", "会议在十点三十分开始"),
    ("晚饭在7:05开始", "晚饭在七点零五分开始"),
    ("比分是3:2", "比分是三比二"),
    ("我需要2个小时", "我需要两个小时"),
    ("第2名", "第二名"),
    ("花了2000元", "花了两千元"),
    ("一共1,000,000人", "一共一百万人"),
    ("房间号是305", "房间号是三百零五"),
    ("只有1/3的人", "只有三分之一的人"),
    ("温度-5度", "温度负五度"),
    ("三到五天", "三到五天"),
    ("３-５天", "三到五天"),
    ("這個問題很簡單", "这个问题很简单"),
    ("他说：“好的！”", "他说好的"),
    ("我用 iPhone 拍照。", "我用iphone拍照"),
    ("Hello,  World!  Don't", "hello world dont"),
    ("OK，就这么定了", "ok就这么定了"),
])
def test_normalize_cases(raw, expected):
    assert normalize(raw) == expected


def test_normalize_is_idempotent_on_corpus_and_odd_inputs():
    for t in corpus_texts() + ["", "   ", "？！。", "ni3 hao3 ma5", "a1 b2 mp3", "1234567"]:
        once = normalize(t)
        assert normalize(once) == once, t


def test_normalize_keeps_toned_syllables_but_reads_other_digits():
    assert normalize("Ni3 hao3  MA5") == "ni3 hao3 ma5"
    assert normalize("mp3播放器") == "mp三播放器"  # "mp" is not a syllable


# ---------------------------------------------------------------- pinyin

def test_polyphones_follow_context():
    assert pinyin("银行") == ["yin2", "hang2"]
    assert pinyin("行走") == ["xing2", "zou3"]
    assert pinyin("重要") == ["zhong4", "yao4"]
    assert pinyin("重新") == ["chong2", "xin1"]
    assert pinyin("还是") == ["hai2", "shi4"]
    assert pinyin("还给我") == ["huan2", "gei3", "wo3"]
    assert pinyin("快乐") == ["kuai4", "le4"]
    assert pinyin("音乐") == ["yin1", "yue4"]


def test_tone_sandhi_and_neutral_tone():
    assert pinyin("你好") == ["ni2", "hao3"]      # 3-3 sandhi
    assert pinyin("一个") == ["yi2", "ge4"]       # 一 before a 4th tone
    assert pinyin("不是") == ["bu2", "shi4"]      # 不 before a 4th tone
    assert pinyin("我们的桌子") == ["wo3", "men5", "de5", "zhuo1", "zi5"]
    assert pinyin("绿色") == ["lv4", "se4"]


def test_pinyin_mixed_english_and_tones_off():
    assert pinyin("我用iPhone拍照。") == ["wo3", "yong4", "iphone", "pai1", "zhao4"]
    assert pinyin("你好吗", tones=False) == ["ni", "hao", "ma"]
    assert pinyin("我用iPhone", tones=False) == ["wo", "yong", "iphone"]


def test_pinyin_is_idempotent_on_its_own_output():
    for t in corpus_texts():
        p = pinyin(t)
        assert pinyin(" ".join(p)) == p, t
        # no sandhi re-applied: "ni3 hao3" stays ni3 (the model said ni3)
    assert pinyin("ni3 hao3") == ["ni3", "hao3"]


def test_is_pinyin_transcript():
    assert is_pinyin_transcript("ni2 hao3 ma5")
    assert is_pinyin_transcript("wo3 yong4 iphone pai1 zhao4")
    assert not is_pinyin_transcript("")
    assert not is_pinyin_transcript("hello world")
    assert not is_pinyin_transcript("你好 ni3")
    assert not is_pinyin_transcript("xyz9 ni3")


# ---------------------------------------------------------------- error rates

def test_error_rates_at_known_values():
    assert pinyin_error_rate("你好吗", "你好吗") == 0.0
    assert pinyin_error_rate("你好吗", "ni2 hao3 ma5") == 0.0
    assert pinyin_error_rate("你好吗", "ni3 hao3 ma5") == pytest.approx(1 / 3)
    assert pinyin_error_rate("你好吗", "ni3 hao3 ma5", tones=False) == 0.0
    assert pinyin_error_rate("一二三四五", "一二三") == pytest.approx(2 / 5)
    # insertions can push the rate above 1
    assert pinyin_error_rate("你好", "你好你好你好") == pytest.approx(2.0)
    # homophones cost nothing in pinyin but count in CER
    assert pinyin_error_rate("他在", "她在") == 0.0
    assert cer("他在", "她在") == pytest.approx(0.5)


def test_punctuation_case_and_script_differences_give_zero_error():
    assert cer("今天天气很好。", "今天，天气很好！") == 0.0
    assert cer("這個問題很簡單", "这个问题很简单") == 0.0
    assert cer("我用iPhone拍照", "我用 IPHONE 拍照。") == 0.0
    assert pinyin_error_rate("今天是2024年3月5日", "今天是二零二四年三月五日") == 0.0
    assert cer("价格上涨了50%", "价格上涨了百分之五十") == 0.0


def test_both_sides_are_normalised():
    # the reference recipe normalised only the reference: digits in the hypothesis
    # would then count as errors
    assert cer("我住在八楼", "我住在8楼") == 0.0
    assert pinyin_error_rate("我住在八楼", "我住在8楼") == 0.0


def test_cer_counts_english_per_letter_and_falls_back_for_pinyin_transcripts():
    assert error_counts("hello world", "hello word") == (1, 11)
    assert cer("你好吗", "ni2 hao3 ma5") == 0.0
    assert cer("你好吗", "ni2 hao3 ma1") == pytest.approx(1 / 3)
    assert error_counts("你好吗", "ni2 hao3 ma1") == (1, 3)


def test_empty_reference():
    assert pinyin_error_rate("", "") == 0.0
    assert pinyin_error_rate("。", "你好") == 1.0
    assert cer("", "") == 0.0
    assert cer("", "a") == 1.0
    assert error_counts("", "你好", "pinyin") == (2, 0)
    assert error_counts("你好", "", "char") == (2, 2)


def test_error_counts_rejects_unknown_unit():
    with pytest.raises(ValueError, match="unit"):
        error_counts("你好", "你好", "word")


# ---------------------------------------------------------------- rewards

def test_tanh_reward_known_points():
    assert rewards.tanh_reward(0.0) == 1.0
    assert rewards.tanh_reward(0.1) == pytest.approx(0.709, abs=1e-3)
    assert rewards.tanh_reward(0.2) == pytest.approx(0.463, abs=1e-3)
    assert rewards.tanh_reward(5.0) == pytest.approx(0.0, abs=1e-6)


def test_tanh_variant_end_to_end():
    ref = "一二三四五六七八九十"  # 10 syllables: one substitution -> c = 0.1
    hyp = "一二三四五六七八九四"
    r = compute_reward("tanh", ref, hyp)
    assert isinstance(r, RewardResult)
    assert r.error_rate == pytest.approx(0.1)
    assert r.reward == pytest.approx(0.709, abs=1e-3)
    assert r.length_ok and r.length_factor == 1.0 and r.length_ratio is None
    two = compute_reward("tanh", ref, "一二三四五六七八四四")
    assert two.reward == pytest.approx(0.463, abs=1e-3)
    assert compute_reward("tanh", ref, ref).reward == 1.0


def test_toneless_variant_ignores_tones():
    assert compute_reward("tanh", "你好吗", "ni3 hao3 ma1").error_rate == pytest.approx(2 / 3)
    r = compute_reward("toneless", "你好吗", "ni3 hao3 ma1")
    assert r.error_rate == 0.0 and r.reward == 1.0
    assert compute_reward("toneless", "你好吗", "ni3 hao3").error_rate == pytest.approx(1 / 3)


def test_exp_reward_known_points():
    # exp(-12 c^1.5), by hand: 0.25^1.5 = 1/8 -> exp(-1.5); 1^1.5 = 1 -> exp(-12); 0.04^1.5 = 0.008
    assert rewards.exp_reward(0.0) == 1.0
    assert rewards.exp_reward(0.25) == pytest.approx(0.22313, abs=1e-5)  # exp(-1.5)
    assert rewards.exp_reward(1.0) == pytest.approx(math.exp(-12.0))
    assert rewards.exp_reward(0.04) == pytest.approx(math.exp(-0.096))
    assert rewards.exp_reward(0.1) == pytest.approx(0.6842, abs=1e-4)


def test_exp_toneless_variant_ignores_tones():
    # tones alone differ: the tone-free error rate is 0, the reward 1 (the toned one would see 2/3)
    r = compute_reward("exp_toneless", "你好吗", "ni1 hao1 ma1")
    assert r.error_rate == 0.0 and r.reward == 1.0
    # one of 3 syllables wrong (and its tone too): c = 1/3, (1/3)^1.5 = 0.19245 -> exp(-2.3094) = 0.09932
    r = compute_reward("exp_toneless", "你好吗", "ni1 hao1 ba1")
    assert r.error_rate == pytest.approx(1 / 3)
    assert r.reward == pytest.approx(0.09932, abs=1e-5)
    # the same error rate under toneless: 1 - tanh(3 / 3) = 0.238, a different shape
    assert compute_reward("toneless", "你好吗", "ni1 hao1 ba1").reward == pytest.approx(1 - math.tanh(1.0))


def test_cer_nll_variant():
    with pytest.raises(ValueError, match="asr_logprob"):
        compute_reward("cer_nll", "你好", "你好")
    with pytest.raises(ValueError, match="finite"):
        compute_reward("cer_nll", "你好", "你好", asr_logprob=float("nan"))
    perfect = compute_reward("cer_nll", "你好", "你好", asr_logprob=0.0)
    assert perfect.reward == 1.0 and perfect.confidence == 1.0
    # harmonic mean of r_cer = 1 - 0.25 and r_conf = exp(-0.5)
    r = compute_reward("cer_nll", "一二三四", "一二三五", asr_logprob=-0.5)
    a, b = 0.75, math.exp(-0.5)
    assert r.error_rate == pytest.approx(0.25)
    assert r.reward == pytest.approx(2 * a * b / (a + b))
    # either term at zero gives zero
    assert compute_reward("cer_nll", "一二", "三四五六", asr_logprob=-0.1).reward == 0.0
    # a confident ASR cannot rescue a wrong transcript, nor a right one an unsure ASR
    assert compute_reward("cer_nll", "一二三四", "一二三五", asr_logprob=-0.01).reward < 0.86
    assert compute_reward("cer_nll", "一二三四", "一二三四", asr_logprob=-3.0).reward < 0.1


def test_unknown_reward_name():
    assert set(REWARDS) == {"tanh", "toneless", "exp_toneless", "tanh_reference", "cer_nll"}
    with pytest.raises(ValueError, match="tanh"):
        compute_reward("nope", "你好", "你好")


# ---------------------------------------------------------------- length guard

RATE = 25.0  # speech tokens per second (CosyVoice2's and CosyVoice3's)

def test_expected_tokens():
    # 3 syllables at 25 tokens/s and 4.5 syllables/s
    assert expected_tokens("你好吗", RATE) == pytest.approx(3 * 25 / 4.5)
    assert expected_tokens("你好吗", token_rate=9.0) == pytest.approx(6.0)
    # English counted by vowel groups: i-pho-ne = 3
    assert expected_tokens("iPhone", token_rate=4.5) == pytest.approx(3.0)
    assert expected_tokens("。", RATE) == 0.0


def test_length_guard_penalises_implausible_lengths_only():
    ref = "今天天气很好我们去公园散步吧"
    exp = expected_tokens(ref, RATE)
    plausible = [compute_reward("tanh", ref, ref, n_tokens=round(exp * k), token_rate=RATE) for k in (0.6, 1.0, 1.9)]
    assert all(r.reward == 1.0 and r.length_ok for r in plausible)
    for k in (3.0, 1 / 3):
        r = compute_reward("tanh", ref, ref, n_tokens=round(exp * k), token_rate=RATE)
        assert not r.length_ok
        assert r.raw_reward == 1.0
        assert 0.3 < r.reward < 0.6  # (2/3)^2 = 0.44 at both ends
        assert r.length_ratio == pytest.approx(k, rel=0.05)
    assert compute_reward("tanh", ref, ref, n_tokens=0, token_rate=RATE).reward == 0.0
    # continuous at the band edge, decreasing beyond it
    rewards = [compute_reward("tanh", ref, ref, n_tokens=round(exp * k), token_rate=RATE).reward
               for k in (2.0, 2.5, 4.0, 8.0)]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] == pytest.approx(1.0, abs=0.02)
    with pytest.raises(ValueError, match="token_rate"):  # no family's rate is assumed
        compute_reward("tanh", ref, ref, n_tokens=10)


def test_length_guard_applies_to_every_variant():
    ref = "今天天气很好"
    n = round(expected_tokens(ref, RATE) * 3)
    for name in REWARDS:
        r = compute_reward(name, ref, ref, asr_logprob=0.0, n_tokens=n, token_rate=RATE)
        assert not r.length_ok and r.reward < r.raw_reward, name
