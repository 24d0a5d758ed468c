"""The simulated speech codec (ttsrl.embedded.codec): round trip, robustness, determinism."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ttsrl import text
from ttsrl.embedded import codec

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "corpus"


def load(name):
    return [json.loads(line) for line in (CORPUS / name).read_text(encoding="utf-8").splitlines()]


def test_corpus_is_split_and_short():
    train, test = load("train.jsonl"), load("test.jsonl")
    # about 280 held-out sentences: the paired interval of a CER drop is a few points wide
    assert 250 <= len(train) <= 400 and 250 <= len(test) <= 320
    ids = [r["id"] for r in train + test]
    assert len(set(ids)) == len(ids)
    assert [r["id"] for r in test] == [f"test_{i:04d}" for i in range(len(test))]
    held_out = [text.normalize(r["text"]) for r in test]
    assert len(set(held_out)) == len(held_out)
    assert not set(held_out) & {text.normalize(r["text"]) for r in train}
    # the tiny tokenizer and the base model are built from the training texts only
    known = set("".join(r["text"] for r in train))
    unknown = {(r["id"], c) for r in test for c in r["text"] if c not in known}
    assert not unknown, sorted(unknown)
    for r in train + test:
        assert 5 <= len(text.pinyin(r["text"])) <= 20, r


@pytest.mark.parametrize("name", ["train.jsonl", "test.jsonl"])
def test_round_trip_on_whole_corpus(name):
    for row in load(name):
        codes = codec.encode(row["text"])
        assert all(0 <= c < codec.CODE_SPACE for c in codes)
        assert text.pinyin(codec.decode(codes)) == text.pinyin(row["text"]), row


def test_encode_shape():
    hao = codec.encode("好")
    assert len(hao) == 2 and codec.decode(hao) == "hao3"
    assert codec.encode("你好") == codec.encode("ni2 hao3")  # sandhi done by text.pinyin
    # zero-initial syllables, ü written v, 儿-type finals
    assert codec.decode(codec.encode("嗯，绿色的耳朵")) == "n2 lv4 se4 de5 er3 duo3"
    # a pause at the comma, a word end after the English word
    codes = codec.encode("好，OK")
    assert codes == hao + [codec.PAUSE] + [codec.LETTER_CODES["o"], codec.LETTER_CODES["k"], codec.WORD_END]
    assert codec.decode(codes) == "hao3 ok"
    assert codec.expected_len("你好，我用iPhone拍照。") == len(codec.encode("你好，我用iPhone拍照。"))
    assert codec.encode("") == [] and codec.decode([]) == ""


def test_an_onset_names_its_final_and_the_final_code_is_heard():
    # 音乐 yin1 yue4: one initial, two onsets, so a reader that finds its place by its last code
    # is not sent back to 音
    yin, yue = codec.encode("音"), codec.encode("乐曲")[:2]
    assert yin[0] != yue[0] and codec.decode(yue) == "yue4"
    assert yin[0] == codec.ONSET_CODES[("y", "in")] and yin[1] == codec.FINAL_CODES[("in", 1)]
    # the ASR hears the onset's initial and the final code's final+tone
    assert codec.decode([yin[0], yue[1]]) == "yue4" and codec.decode([yue[0], yin[1]]) == "yin1"
    # an initial and a final that make no syllable are noise
    assert codec.decode([codec.ONSET_CODES[("b", "a")], codec.FINAL_CODES[("iong", 1)]]) == ""


def test_a_final_said_again_within_the_window_takes_its_second_code():
    # 妈妈 ma1 ma1: the second 妈 repeats the first's onset and final+tone; the final takes its second
    # code, which the ASR hears as the same sound in the same voice
    first, second = codec.FINAL_CODES[("a", 1)], codec.BOOKS["spk0"].second_finals[("a", 1)]
    onset = codec.ONSET_CODES[("m", "a")]
    assert codec.encode("妈妈") == [onset, first, onset, second] and codec.decode([onset, second]) == "ma1"
    assert codec.first_code_unit(codec.unit_of(second)) == codec.unit_of(first) != codec.unit_of(second)
    for s in codec.SPEAKERS:  # every voice has its own second codes, in its own book
        book = codec.BOOKS[s]
        assert set(book.second_finals.values()) <= book.codes
        assert not set(book.second_finals.values()) & set(book.finals.values())
    spk2 = codec.encode("妈妈", "spk2")
    assert spk2 == codec.to_speaker(codec.encode("妈妈"), "spk2") and codec.speaker_share(spk2, "spk2") == 1.0
    # a third within the window: both codes were said, the first comes back (the sampling rule
    # then blocks it); outside the window the first code again
    i4, i4_second = codec.FINAL_CODES[("i", 4)], codec.BOOKS["spk0"].second_finals[("i", 4)]
    assert codec.encode("是是是")[1::2] == [i4, i4_second, i4]
    far = codec.encode("妈" + "你好我们" * 2 + "妈")  # ma1 ... ma1 more than ten codes apart
    assert far[1] == far[-1] == first
    # over the corpus, a final+tone code repeats within the window only where both codes were said
    for row in load("train.jsonl") + load("test.jsonl"):
        codes = codec.encode(row["text"])
        for i, c in enumerate(codes):
            window = codes[max(0, i - codec.REPEAT_WINDOW):i]
            if codec._KIND[c][0] == "final" and c in window:
                book = codec.BOOKS["spk0"]
                value = codec._KIND[c][1]
                assert {book.finals[value], book.second_finals[value]} <= set(window), row


def test_pause_not_inserted_inside_numbers():
    codes = codec.encode("圆周率约等于3.14。")
    assert codec.PAUSE not in codes
    assert codec.decode(codes).split() == text.pinyin("圆周率约等于三点一四")


def test_code_book_is_a_subset_of_the_codec_with_room_for_four_voices():
    assert codec.NUM_CODES == len(codec.USED_CODES) and 4 * codec.NUM_CODES <= codec.CODE_SPACE
    assert all(0 <= c < codec.CODE_SPACE for c in codec.USED_CODES)
    assert set(codec.SILENCE_CODES) <= codec.USED_CODES and len(set(codec.SILENCE_CODES)) == 4


def test_silence_and_noise_decode_to_nothing():
    assert codec.decode(list(codec.SILENCE_CODES) * 5) == ""
    unused = sorted(set(range(codec.CODE_SPACE)) - codec.ALL_CODES)[:50]  # in no speaker's book
    assert codec.decode(unused) == ""
    hello = codec.encode("你好吗")
    noisy = [unused[0]] + hello[:2] + list(codec.SILENCE_CODES[2:]) + hello[2:] + [-1, 10**9]
    # silence between the syllables does not matter; noise is skipped
    assert codec.decode(noisy) == "ni2 hao3 ma5"
    # an onset cut off by silence is dropped; a lone final is dropped
    assert codec.decode([hello[0], codec.PAUSE, hello[1]]) == ""
    assert codec.decode(hello[1:]) == "hao3 ma5"


def test_decode_never_raises_on_garbage():
    rng = random.Random(1234)
    used = sorted(codec.USED_CODES)
    for _ in range(1000):
        n = rng.randint(0, 60)
        stream = [rng.choice((rng.randint(-10**6, 10**6), rng.randint(-5, codec.CODE_SPACE + 5),
                              rng.choice(used), rng.choice(used)))
                  for _ in range(n)]
        out = codec.decode(stream)
        assert isinstance(out, str)
        # whatever comes out is something the reward can score
        assert text.pinyin(" ".join(text.pinyin(out))) == text.pinyin(out)
    assert codec.decode([1.5, "7", None, object(), 2**70]) == ""
    # integer-like arrays (what a sampler hands over) are accepted
    numpy = pytest.importorskip("numpy")
    assert codec.decode(numpy.array(codec.encode("你好吗"), dtype=numpy.int32)) == "ni2 hao3 ma5"


def test_mapping_is_deterministic_across_processes():
    script = ("import json; from ttsrl.embedded import codec; "
              "print(json.dumps([codec.encode(t) for t in ['你好，世界', '我用iPhone拍照', "
              "'今天是2024年3月5日']] + [sorted(codec.SILENCE_CODES)]))")
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    here = [codec.encode(t) for t in ["你好，世界", "我用iPhone拍照", "今天是2024年3月5日"]]
    assert outs[0][:3] == here and outs[0][3] == sorted(codec.SILENCE_CODES)
