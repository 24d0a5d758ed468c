"""CosyVoice2 token2wav run with CosyVoice's own code (PyPI cosyvoice-minicpmo) on CPU.

CosyVoice2-0.5B's weights cannot be had here, so the model folder is built by the test
(tests/cosyvoice2_tiny.py): CosyVoice's own flow and HiFT classes from a shrunk copy of the
released yaml, random weights, ONNX stand-ins with the real signatures for campplus and the
speech tokenizer. Weights are random: these tests check shapes, sample rate, duration per
token, determinism, device handling and that the server and the evaluator get audio, not
quality.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

for mod, why in (("cosyvoice.cli.model", "CosyVoice's runtime (cosyvoice-minicpmo)"), ("hyperpyyaml", "hyperpyyaml"),
                 ("onnx", "onnx"), ("whisper", "openai-whisper"), ("matcha.utils.audio", "Matcha-TTS (cosyvoice-minicpmo)")):
    pytest.importorskip(mod, reason=f"{why} is not installed (bash scripts/install.sh installs it)")

sys.path.insert(0, str(Path(__file__).parent))
from cosyvoice2_tiny import write_tone_wav  # noqa: E402

from ttsrl.families import family  # noqa: E402
from ttsrl.reward.backends import BackendConfig, build_pipeline  # noqa: E402
from ttsrl.reward.backends.cosyvoice import (  # noqa: E402
    CosyVoiceConfig,
    CosyVoiceToken2Wav,
    check_prompt_wav,
)
from ttsrl.reward.backends.cosyvoice_code import check_model_dir  # noqa: E402

COSYVOICE2 = family("cosyvoice2").token2wav

RATE = 24000
SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 tokens per second


@pytest.fixture(scope="module")
def folders(cosyvoice2_folders):
    return cosyvoice2_folders


@pytest.fixture(scope="module")
def t2w(folders):
    model, prompts = folders
    return CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))


def codes(n, start=0):
    return [(start + 37 * i) % 6561 for i in range(n)]


@pytest.mark.slow  # CosyVoice2 token2wav: ~6 s (+6 s model load)
def test_waveforms_from_tokens(t2w):
    a, b = t2w.synthesize([codes(12), codes(25, 5)], [None, t2w.prompts[1]])
    assert t2w.sample_rate == RATE and t2w.token_rate == 25.0
    for audio, n in ((a, 12), (b, 25)):
        assert audio.sample_rate == RATE and audio.waveform.dtype == np.float32
        assert audio.waveform.shape == (n * SAMPLES_PER_TOKEN,)  # 40 ms per token
        assert audio.duration_s == pytest.approx(n / 25.0)
        assert np.isfinite(audio.waveform).all() and 0 < np.abs(audio.waveform).max() <= 1.0
    again = t2w.synthesize([codes(12)], [None])[0]
    assert np.array_equal(again.waveform, a.waveform)  # HiFT's noise is seeded from the codes
    other = t2w.synthesize([codes(12)], [t2w.prompts[1]])[0]
    assert not np.allclose(other.waveform, a.waveform)  # the speaker prompt matters


def test_llm_is_never_built(t2w):
    # the yaml keeps its `llm:` entry over an empty CosyVoice-BlankEN/: building it would raise
    assert getattr(t2w._model, "llm", None) is None and "pyworld" not in sys.modules


def test_prompts_are_extracted_with_cosyvoice_frontend(t2w):
    names = [p.name for p in t2w.prompts]
    assert names == ["spk_a", "spk_b"]
    for p, sec in zip(t2w.prompts, (1.2, 1.0)):
        tok, feat, emb = p.data["prompt_token"], p.data["prompt_feat"], p.data["embedding"]
        assert tok.shape[0] == 1 and abs(tok.shape[1] - 25 * sec) <= 2  # 25 Hz speech tokens
        assert feat.shape[1] == 2 * tok.shape[1] and feat.shape[2] == 80  # CosyVoice2: 2 mel frames per token
        assert emb.shape == (1, 192)


@pytest.mark.slow  # CosyVoice2 decoding: ~10 s
def test_zero_shot_prompt_wav_is_the_speaker(t2w, folders, tmp_path):
    wav = write_tone_wav(tmp_path / "utt_prompt.wav", 0.8, 16000, 300.0)
    p = t2w.prompt_from_wav(str(wav))
    assert p.data["wav"] == str(wav) and t2w.prompt_from_wav(str(wav)) is p  # cached
    own = t2w.synthesize([codes(10)], [p])[0]
    by_text = t2w.synthesize([codes(10)], [None])[0]
    assert own.waveform.shape == by_text.waveform.shape and not np.allclose(own.waveform, by_text.waveform)


def test_model_folder_and_prompt_checks(folders, tmp_path):
    model, _ = folders
    with pytest.raises(FileNotFoundError) as e:
        check_model_dir(tmp_path, COSYVOICE2)
    msg = str(e.value)
    for f in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx"):
        assert f in msg  # one message naming everything missing
    check_model_dir(model, COSYVOICE2)
    low = write_tone_wav(tmp_path / "low.wav", 1.0, 8000)
    with pytest.raises(ValueError, match="8000 Hz"):
        check_prompt_wav(low)
    long = write_tone_wav(tmp_path / "long.wav", 31.0, 16000)
    with pytest.raises(ValueError, match="30"):
        check_prompt_wav(long)


@pytest.mark.slow  # CosyVoice2 frontend + token2wav: ~7 s
def test_evaluator_zero_shot_path(folders, t2w, tmp_path):
    from ttsrl.data.testsets import Utterance
    from ttsrl.eval.evaluate import score
    from ttsrl.model.generate import Generated

    model, prompts = folders
    pipe = build_pipeline(BackendConfig(backend="cosyvoice2", asr="sim", cosyvoice_model_dir=str(model),
                                        prompt_dir=str(prompts)), "cpu")
    wav = str(write_tone_wav(tmp_path / "p1.wav", 0.8, 16000, 260.0))
    utts = [Utterance("u1", "你好", "今天", (1, 2, 3), wav), Utterance("u2", "再见")]
    gens = [Generated(codes(15), True), Generated(codes(8, 3), True)]
    rows = score(pipe, utts, gens, wav_dir=tmp_path / "wavs")
    assert [r["failure"] for r in rows] == [False, False]
    # length ratio at the model's token rate (25/s): 2 syllables at 4.5/s expect 11.1 tokens
    assert pipe.token_rate == 25.0
    assert [r["length_ratio"] for r in rows] == [pytest.approx(15 / (2 * 25 / 4.5)), pytest.approx(8 / (2 * 25 / 4.5))]
    import soundfile as sf

    for r, n in zip(rows, (15, 8)):
        data, rate = sf.read(tmp_path / "wavs" / f"{r['id']}.wav")
        assert rate == RATE and len(data) == n * SAMPLES_PER_TOKEN
    own = pipe.transcribe_tokens([codes(15)], ["你好"], [wav])[0]
    assert own.prompt == "p1"  # the utterance's own prompt wav voiced it, not a prompt_dir speaker
    assert pipe.transcribe_tokens([codes(15)], ["你好"])[0].prompt in ("spk_a", "spk_b")


def test_two_replicas_behind_the_http_server(folders):
    import requests

    from ttsrl.reward.server import BackgroundServer, ServerConfig

    model, prompts = folders
    backend = BackendConfig(backend="cosyvoice2", asr="sim", cosyvoice_model_dir=str(model), prompt_dir=str(prompts))
    with BackgroundServer(ServerConfig(backend=backend, port=0, devices=["cpu", "cpu"], max_batch=1)) as srv:
        replicas = srv.server.pipelines
        assert not any(p.want_sim for p in replicas)  # speaker similarity only when asked (test_sim_reward.py)
        texts = ["你好", "今天天气很好", "我们去散步", "谢谢你", "再见", "早上好"]

        def ask(i):
            c = codes(10 + i, i)
            payload = {"inputs": [
                {"name": "TOKENS", "shape": [1, len(c)], "datatype": "INT32", "data": [c]},
                {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(c)]]},
                {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [texts[i]]}]}
            r = requests.post(f"{srv.url}/v2/models/token2wav_asr/infer", json=payload, timeout=600)
            assert r.status_code == 200, r.text
            return {o["name"]: o["data"][0] for o in r.json()["outputs"]}

        before = [p.token2wav.n_synthesized for p in replicas]
        with ThreadPoolExecutor(len(texts)) as ex:
            outs = list(ex.map(ask, range(len(texts))))
        assert all(0.0 <= o["REWARDS"] <= 1.0 for o in outs)
        stats = requests.get(f"{srv.url}/v2/models/token2wav_asr/stats", timeout=30).json()
        assert len(stats["replicas"]) == 2 and stats["backend_errors"] == 0 and stats["items"] >= len(texts)
        done = [p.token2wav.n_synthesized - b for p, b in zip(replicas, before)]
        assert sum(done) == len(texts) and all(d > 0 for d in done), done  # both replicas worked


@pytest.mark.slow  # CLI round trips on CosyVoice's runtime: ~20 s
def test_prompt_token_tool_writes_what_stage4_reads(folders, tmp_path):
    import json
    import subprocess

    from ttsrl.data.testsets import read_test_set

    model, _ = folders
    d = tmp_path / "zh"
    (d / "prompt-wavs").mkdir(parents=True)
    write_tone_wav(d / "prompt-wavs" / "a.wav", 1.0, 16000, 200.0)
    write_tone_wav(d / "prompt-wavs" / "b.wav", 0.6, 24000, 150.0)
    (d / "meta.lst").write_text("a|今天天气很好|prompt-wavs/a.wav|你好\nb|银行|prompt-wavs/b.wav|重庆\n", encoding="utf-8")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "prompt_tokens.py"), str(d), "--model-dir", str(model)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (d / "prompt_speech_tokens.jsonl").read_text().splitlines()]
    assert [x["id"] for x in rows] == ["a", "b"]
    for x, sec in zip(rows, (1.0, 0.6)):
        assert abs(len(x["prompt_speech_tokens"]) - 25 * sec) <= 2
        assert all(0 <= t < 6561 for t in x["prompt_speech_tokens"])
    ts = read_test_set("seed", d)  # stage 4's reader: zero-shot, each utterance with its own wav
    assert not ts.notes and [u.prompt_wav for u in ts.utterances] == [str((d / "prompt-wavs" / f).resolve())
                                                                      for f in ("a.wav", "b.wav")]
    assert ts.utterances[0].prompt_speech == tuple(rows[0]["prompt_speech_tokens"])
    # a prompt that CosyVoice cannot take is refused with its name
    write_tone_wav(d / "prompt-wavs" / "a.wav", 1.0, 8000, 200.0)
    r = subprocess.run([sys.executable, str(root / "scripts" / "prompt_tokens.py"), str(d), "--model-dir", str(model),
                        "--output", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "8000 Hz" in r.stderr and not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # CosyVoice2 speaker model: ~6 s
def test_speaker_similarity_is_the_cosine_of_cosyvoice_campplus_embeddings(t2w, folders, tmp_path):
    """SIM = cosine of the embeddings CosyVoice's frontend gives the prompt speaker.

    The fixture is random-weighted (campplus is a random stand-in of the real signature):
    this checks the code path and the arithmetic, not that the number measures a speaker."""
    import soundfile as sf
    import torch
    import torchaudio

    from ttsrl.reward.backends import Audio

    p = t2w.prompts[0]
    audio = t2w.synthesize([codes(30)], [p])[0]
    got = t2w.speaker_similarity([audio], [p])
    # by hand: 24 kHz -> 16 kHz with torchaudio, CosyVoice's own embedding function, cosine
    speech = torchaudio.transforms.Resample(orig_freq=RATE, new_freq=16000)(torch.from_numpy(audio.waveform)[None])
    emb = t2w._fe._extract_spk_embedding(speech).reshape(-1).double()
    ref = p.data["embedding"].reshape(-1).double()
    want = float(emb @ ref / (emb.norm() * ref.norm()))
    # a cosine of two float32 192-d embeddings computed by the same code: equal up to float32
    # rounding of the dot product (~1e-7)
    assert got == [pytest.approx(want, abs=1e-6)] and -1.0 <= got[0] < 0.9999

    # a waveform against the embedding of its own audio (the prompt made from that wav): 1.0
    for rate in (16000, 24000):
        wav = write_tone_wav(tmp_path / f"self_{rate}.wav", 0.9, rate, 210.0)
        data, sr = sf.read(str(wav), dtype="float32")
        own = t2w.prompt_from_wav(str(wav))
        sims = t2w.speaker_similarity([Audio(data, sr)], [own])
        assert sims == [pytest.approx(1.0, abs=1e-6)]
        assert t2w.speaker_similarity([Audio(data, sr)], [t2w.prompts[1]])[0] < 0.9999  # another speaker
    # nothing to embed: no waveform, or shorter than one 25 ms fbank frame
    assert t2w.speaker_similarity([Audio(None, RATE, codes=(1, 2)), Audio(np.zeros(300, np.float32), RATE)],
                                  [p, p]) == [None, None]


@pytest.mark.slow  # CosyVoice2 decoding: ~8 s
def test_pipeline_measures_sim_only_when_asked(folders, t2w):
    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.sim import SimASR

    off = SpeechPipeline(t2w, SimASR())  # the reward server's default: no SIM
    assert [t.sim for t in off.transcribe_tokens([codes(12)], ["你好"])] == [None]
    on = SpeechPipeline(t2w, SimASR(), want_sim=True)
    tr = on.transcribe_tokens([codes(12), []], ["你好", "再见"])
    prompt = next(p for p in t2w.prompts if p.name == tr[0].prompt)
    assert tr[0].sim == pytest.approx(t2w.speaker_similarity([tr[0].audio], [prompt])[0])
    assert tr[1].sim is None  # nothing voiced


@pytest.mark.slow  # stage 4 through CosyVoice2's token2wav and speaker model: 9-11 s on a 2-core AMD EPYC
def test_stage4_sweep_reports_sim_on_cosyvoice2(folders, tiny_hf, tmp_path):
    """Stage 4 on the cosyvoice2 backend (random-weighted fixture): every utterance with
    speech has a `sim`, the summaries their mean and interval, report.md the column."""
    import json
    import shutil

    from ttsrl.eval.evaluate import EvalConfig, run_sweep
    from ttsrl.model.checkpoint import write_marker
    from ttsrl.model.generate import GenerationConfig

    model, prompts = folders
    merged = tmp_path / "merged"
    shutil.copytree(tiny_hf, merged / "step_2")  # the start model again: greedy, the same speech
    write_marker(merged / "step_2", {"step": 2})
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"id": f"t{i}", "text": t}, ensure_ascii=False) + "\n"
                            for i, t in enumerate(["你好", "今天天气很好"])), encoding="utf-8")
    out = tmp_path / "eval"
    backend = BackendConfig(backend="cosyvoice2", asr="sim", cosyvoice_model_dir=str(model), prompt_dir=str(prompts))
    cfg = EvalConfig(start_model=str(tiny_hf), merged_dir=str(merged), out_dir=str(out), test_sets=[("a", str(test))],
                     backend=backend,
                     engine="hf", device="cpu", threads=1, resamples=200, save_wavs=False,
                     generation=GenerationConfig(greedy=True))
    rows = run_sweep(cfg, log=lambda _: None)
    res = [json.loads(x) for x in (out / "step_0" / "a" / "results.jsonl").read_text().splitlines()]
    assert len(res) == 2 and all("sim" in r for r in res)
    got = [r["sim"] for r in res if r["sim"] is not None]
    assert got and all(-1.0 <= s <= 1.0 for s in got)
    assert all(r["sim"] is None for r in res if r["failure"])
    row, row2 = rows
    assert (row2["sim_mean"], row2["sim_n"]) == (row["sim_mean"], row["sim_n"])
    d = row2["sim_vs_start"]  # paired on the same utterances: the same model loses no speaker
    assert (d["diff"], d["lo"], d["hi"], d["n"]) == (0.0, 0.0, 0.0, len(got)) and "sim_vs_start" not in row
    assert row["sim_n"] == len(got) and row["sim_mean"] == pytest.approx(sum(got) / len(got))
    assert row["sim_ci"][0] <= row["sim_mean"] <= row["sim_ci"][1]
    s = json.loads((out / "step_0" / "a" / "summary.json").read_text())
    assert (s["sim_mean"], s["sim_n"]) == (row["sim_mean"], row["sim_n"])
    report = (out / "report.md").read_text()
    assert "| SIM (campplus) [95% CI] |" in report and f"{row['sim_mean']:.3f}" in report
    assert "Δ vs start +0.000 [+0.000, +0.000]" in report
    assert "not the Seed-TTS eval SIM" in report
