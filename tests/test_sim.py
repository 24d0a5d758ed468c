"""The simulated speech codec (ttsrl.sim): round trip, robustness, determinism."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ttsrl import sim, text
from ttsrl.vocab import SPEECH_TOKEN_SIZE

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
        codes = sim.encode(row["text"])
        assert all(0 <= c < SPEECH_TOKEN_SIZE for c in codes)
        assert text.pinyin(sim.decode(codes)) == text.pinyin(row["text"]), row


def test_encode_shape():
    hao = sim.encode("好")
    assert len(hao) == 2 and sim.decode(hao) == "hao3"
    assert sim.encode("你好") == sim.encode("ni2 hao3")  # sandhi done by text.pinyin
    # zero-initial syllables, ü written v, 儿-type finals
    assert sim.decode(sim.encode("嗯，绿色的耳朵")) == "n2 lv4 se4 de5 er3 duo3"
    # a pause at the comma, a word end after the English word
    codes = sim.encode("好，OK")
    assert codes == hao + [sim.PAUSE] + [sim.LETTER_CODES["o"], sim.LETTER_CODES["k"], sim.WORD_END]
    assert sim.decode(codes) == "hao3 ok"
    assert sim.expected_len("你好，我用iPhone拍照。") == len(sim.encode("你好，我用iPhone拍照。"))
    assert sim.encode("") == [] and sim.decode([]) == ""


def test_pause_not_inserted_inside_numbers():
    codes = sim.encode("圆周率约等于3.14。")
    assert sim.PAUSE not in codes
    assert sim.decode(codes).split() == text.pinyin("圆周率约等于三点一四")


def test_code_book_is_a_small_subset_of_the_codec():
    assert sim.NUM_CODES == len(sim.USED_CODES) < SPEECH_TOKEN_SIZE // 10
    assert all(0 <= c < SPEECH_TOKEN_SIZE for c in sim.USED_CODES)
    assert set(sim.SILENCE_CODES) <= sim.USED_CODES and len(set(sim.SILENCE_CODES)) == 4


def test_silence_and_noise_decode_to_nothing():
    assert sim.decode(list(sim.SILENCE_CODES) * 5) == ""
    unused = sorted(set(range(SPEECH_TOKEN_SIZE)) - sim.USED_CODES)[:50]
    assert sim.decode(unused) == ""
    hello = sim.encode("你好吗")
    noisy = [unused[0]] + hello[:2] + list(sim.SILENCE_CODES[2:]) + hello[2:] + [-1, 10**9]
    # silence between the syllables does not matter; noise is skipped
    assert sim.decode(noisy) == "ni2 hao3 ma5"
    # an initial cut off by silence is dropped; a lone final is dropped
    assert sim.decode([hello[0], sim.PAUSE, hello[1]]) == ""
    assert sim.decode(hello[1:]) == "hao3 ma5"


def test_decode_never_raises_on_garbage():
    rng = random.Random(1234)
    used = sorted(sim.USED_CODES)
    for _ in range(1000):
        n = rng.randint(0, 60)
        stream = [rng.choice((rng.randint(-10**6, 10**6), rng.randint(-5, SPEECH_TOKEN_SIZE + 5),
                              rng.choice(used), rng.choice(used)))
                  for _ in range(n)]
        out = sim.decode(stream)
        assert isinstance(out, str)
        # whatever comes out is something the reward can score
        assert text.pinyin(" ".join(text.pinyin(out))) == text.pinyin(out)
    assert sim.decode([1.5, "7", None, object(), 2**70]) == ""
    # integer-like arrays (what a sampler hands over) are accepted
    numpy = pytest.importorskip("numpy")
    assert sim.decode(numpy.array(sim.encode("你好吗"), dtype=numpy.int32)) == "ni2 hao3 ma5"


def test_mapping_is_deterministic_across_processes():
    script = ("import json; from ttsrl import sim; "
              "print(json.dumps([sim.encode(t) for t in ['你好，世界', '我用iPhone拍照', "
              "'今天是2024年3月5日']] + [sorted(sim.SILENCE_CODES)]))")
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    here = [sim.encode(t) for t in ["你好，世界", "我用iPhone拍照", "今天是2024年3月5日"]]
    assert outs[0][:3] == here and outs[0][3] == sorted(sim.SILENCE_CODES)
