"""Speaker similarity kept by the reward: the reward server's SIMS output
and the combined reward (error-rate term + W x SIM), on a real server on loopback; and the
naturalness term beside it (+ M x (DNSMOS OVRL - 1) / 4, the MOS_OVRLS output).

The CosyVoice2 folder is the random-weight one of tests/cosyvoice2_tiny.py (campplus is an
ONNX stand-in with the real signature), with two prompt speakers: these tests check that SIM
is CosyVoice2's campplus cosine of the audio the reward heard, that it follows the prompt
speaker, and that weight 0 leaves the reward exactly the error-rate reward; not quality.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import requests

for mod, why in (("cosyvoice.cli.model", "CosyVoice's runtime (cosyvoice-minicpmo)"), ("hyperpyyaml", "hyperpyyaml"),
                 ("onnx", "onnx"), ("matcha.utils.audio", "Matcha-TTS (cosyvoice-minicpmo)")):
    pytest.importorskip(mod, reason=f"{why} is not installed (bash scripts/install.sh installs it)")

from ttsrl.model.vocab import SpeechVocab  # noqa: E402
from ttsrl.reward.backends import BackendConfig, SpeechPipeline  # noqa: E402
from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav  # noqa: E402
from ttsrl.reward.backends.sim import SimASR  # noqa: E402
from ttsrl.reward.client import RewardClientConfig, compute_score  # noqa: E402
from ttsrl.reward.protocol import MOS_OUTPUT, build_payload, infer_path  # noqa: E402
from ttsrl.reward.rewards import naturalness_term  # noqa: E402
from ttsrl.reward.server import BackgroundServer, ServerConfig  # noqa: E402
from ttsrl.reward.triton_binary import HEADER, attach_inputs, split_body  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["你好", "今天天气很好", "我们去散步", "谢谢你", "再见", "早上好", "晚上好", "明天见"]


@pytest.fixture(scope="module")
def t2w(cosyvoice2_folders):
    model, prompts = cosyvoice2_folders
    return CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))


def codes(n: int, start: int = 0) -> list[int]:
    return [(start + 37 * i) % 6561 for i in range(n)]


def serve(t2w, **cfg) -> BackgroundServer:
    """A loopback server over ``t2w`` (one replica, its own pipeline) with these settings."""
    return BackgroundServer(ServerConfig(port=0, max_batch=4, **cfg), pipelines=[SpeechPipeline(t2w, SimASR())])


def outputs(url: str, c: list[int], text: str, binary: bool = False, names: tuple[str, ...] | None = None) -> dict:
    body = build_payload(c, text, outputs=names)
    if binary:
        body["parameters"] = {"binary_data_output": True}
    r = requests.post(url + infer_path(), json=body, timeout=300)
    assert r.status_code == 200, r.text
    if not binary:
        return {o["name"]: o["data"][0] for o in r.json()["outputs"]}
    head, raw = split_body(r.content, r.headers[HEADER])
    outs = json.loads(head)["outputs"]
    attach_inputs(outs, raw)  # the extension's decoding, outputs as inputs
    return {o["name"]: o["data"][0] for o in outs}


def by_speaker(t2w) -> dict[str, str]:
    """One text per prompt speaker (the server voices a text by the hash of its normalised form)."""
    pick = SpeechPipeline(t2w, SimASR())
    found = {}
    for text in TEXTS:
        found.setdefault(pick.prompt_for(text).name, text)
    assert len(found) == 2, found  # both speakers of the fixture are reached
    return found


def test_weight_zero_is_the_error_rate_reward_and_sim_follows_the_speaker(t2w):
    """The issue's check: SIM weight 0 gives the CER-only reward exactly; SIM changes when the
    prompt speaker changes; weight W adds W x SIM; SIMS is the campplus cosine of what was heard."""
    texts = by_speaker(t2w)
    c = codes(24, 5)
    cases = [(c, t) for t in texts.values()] + [(codes(12, 900), TEXTS[3])]
    with serve(t2w) as plain:
        cer_only = [outputs(plain.url, *x) for x in cases]
    assert all("SIMS" not in o for o in cer_only)  # not measured: left out (strict JSON, no NaN)
    with serve(t2w, want_sim=True) as w0:
        zero = [outputs(w0.url, *x) for x in cases]
        binary = outputs(w0.url, *cases[0], binary=True)
    with serve(t2w, sim_weight=0.5) as w:
        weighted = [outputs(w.url, *x) for x in cases]
    for a, b, d in zip(cer_only, zero, weighted):
        assert b["REWARDS"] == a["REWARDS"] and b["ERROR_RATES"] == a["ERROR_RATES"]  # bit for bit
        assert -1.0 <= b["SIMS"] <= 1.0 and d["SIMS"] == b["SIMS"]
        assert d["REWARDS"] == pytest.approx(a["REWARDS"] + 0.5 * b["SIMS"], abs=1e-12)
    spk = list(texts)
    assert abs(zero[0]["SIMS"] - zero[1]["SIMS"]) > 1e-3, (spk, zero)  # same codes, other speaker
    assert binary["SIMS"] == pytest.approx(zero[0]["SIMS"], abs=1e-6)  # FP32 in the binary encoding
    assert binary["REWARDS"] == pytest.approx(zero[0]["REWARDS"], abs=1e-6)
    # the value is Token2Wav.speaker_similarity of the audio voiced for that text's prompt
    pipe = SpeechPipeline(t2w, SimASR(), want_sim=True)
    tr = pipe.transcribe_tokens([c], [texts[spk[0]]])[0]
    # the same float32 token2wav + campplus forward, once in the server's worker thread and once
    # here: other thread splits and vector widths sum in other orders. Measured |diff| 0 with
    # AVX-512 kernels, 4.1e-6 with torch's AVX2 ones (ATEN_CPU_CAPABILITY=avx2); 1e-4 is
    # 25x that and 10x below the gap between two speakers asserted above (> 1e-3)
    assert tr.sim == pytest.approx(zero[0]["SIMS"], abs=1e-4)
    assert tr.sim == pytest.approx(t2w.speaker_similarity([tr.audio], [pipe.prompt_for(texts[spk[0]])])[0])


def test_empty_speech_and_output_selection_on_a_sim_server(t2w):
    """Nothing voiced: reward 0 and SIMS NaN (JSON and binary). SIMS obeys the output
    selection and per-output binary flags like the other outputs; bad flags are 400s."""
    with serve(t2w, sim_weight=0.1) as srv:
        empty = outputs(srv.url, [], TEXTS[0])
        assert empty["REWARDS"] == 0.0 and math.isnan(empty["SIMS"])
        assert math.isnan(outputs(srv.url, [], TEXTS[0], binary=True)["SIMS"])
        body = build_payload(codes(10), TEXTS[1]) | {"outputs": [{"name": "SIMS"}]}
        r = requests.post(srv.url + infer_path(), json=body, timeout=300)
        assert r.status_code == 200 and [o["name"] for o in r.json()["outputs"]] == ["SIMS"]
        bad = {"binary_data not a bool": {"binary_data": "yes"}, "classification": {"classification": 2},
               "shared memory": {"shared_memory_region": "x"}, "parameters not an object": [1]}
        for why, params in bad.items():
            body = build_payload(codes(10), TEXTS[1]) | {"outputs": [{"name": "SIMS", "parameters": params}]}
            r = requests.post(srv.url + infer_path(), json=body, timeout=30)
            assert r.status_code == 400 and "SIMS" in r.json()["error"], (why, r.text)
        meta = requests.get(f"{srv.url}/v2/models/token2wav_asr", timeout=30).json()
        assert "SIMS" in [o["name"] for o in meta["outputs"]] and meta["sim_weight"] == 0.1
        stats = requests.get(f"{srv.url}/v2/models/token2wav_asr/stats", timeout=30).json()
        assert stats["backend_errors"] == 0 and stats["server_errors"] == 0


def test_client_hands_sim_to_verl(t2w):
    """compute_score (what verl calls) returns the server's SIMS as extra info ``sim`` (0.0
    where nothing was measured, so the column stays finite for logging and gdpo)."""
    text = TEXTS[2]
    c = codes(16, 3)
    with serve(t2w, want_sim=True) as srv:
        got = asyncio.run(compute_score("t", SpeechVocab.codes_to_text(c), text,
                                        config=RewardClientConfig(url=srv.url)))
        expect = outputs(srv.url, c, text)
        empty = asyncio.run(compute_score("t", "", text, config=RewardClientConfig(url=srv.url)))
    assert got["sim"] == pytest.approx(expect["SIMS"]) and got["score"] == pytest.approx(expect["REWARDS"])
    assert set(got) == set(empty) and empty["sim"] == 0.0
    assert got["sim_measured"] == 1.0 and empty["sim_measured"] == 0.0  # nothing voiced: a 0.0 that is no SIM
    with serve(t2w) as srv:
        plain = asyncio.run(compute_score("t", SpeechVocab.codes_to_text(c), text,
                                          config=RewardClientConfig(url=srv.url)))
    assert plain["sim"] == 0.0 and plain["sim_measured"] == 0.0 and plain["score"] == got["score"]


@pytest.mark.slow  # a server CLI round trip: ~6 s
def test_a_backend_without_a_speaker_model_refuses_sim_at_start(tmp_path):
    """The sim backend has no speaker model: --sim-weight > 0 (and --want-sim) stop the server
    at start with a message saying why; a bad weight is a usage error."""
    with pytest.raises(ValueError, match="--sim-weight 0.1 needs a speaker model, and backend sim has none"):
        with BackgroundServer(ServerConfig(backend=BackendConfig(backend="sim"), port=0, sim_weight=0.1)):
            pass
    with pytest.raises(ValueError, match="--want-sim needs a speaker model"):
        with BackgroundServer(ServerConfig(port=0, want_sim=True)):
            pass
    cli = [sys.executable, str(ROOT / "token2wav_asr_server.py"), "--backend", "sim", "--port", "0"]
    p = subprocess.run(cli + ["--sim-weight", "0.1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "needs a speaker model" in p.stderr and "Traceback" not in p.stderr, p.stderr
    for bad in ("-1", "nan", "inf"):
        p = subprocess.run(cli + ["--sim-weight", bad], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 2 and "sim_weight must be a finite number >= 0" in p.stderr, p.stderr


@pytest.mark.slow  # the real DNSMOS: ~0.6 s an utterance on 2 cores, several of them (warm-ups included)
def test_mos_weight_adds_the_naturalness_term_of_the_real_dnsmos(t2w):
    """--mos-weight M: REWARDS = the error-rate reward + M x (OVRL - 1) / 4 (clipped), OVRL the real
    DNSMOS P.835 of the audio the reward heard, returned as MOS_OVRLS when asked for by name (an
    old request's answer lacks it); nothing voiced: NaN and reward 0; the metadata and every answer
    advertise the range [0, 1 + M]; a client expecting another MOS weight refuses the answers."""
    text, c = TEXTS[1], codes(40, 7)
    names = ("REWARDS", "ERROR_RATES", MOS_OUTPUT)
    with serve(t2w) as plain:
        cer_only = outputs(plain.url, c, text, names=names)
    assert math.isnan(cer_only[MOS_OUTPUT])  # not measured
    with serve(t2w, mos_weight=0.5) as srv:
        got = outputs(srv.url, c, text, names=names)
        assert MOS_OUTPUT not in outputs(srv.url, c, text)  # the reference request: unchanged outputs
        empty = outputs(srv.url, [], text, names=names)
        meta = requests.get(f"{srv.url}/v2/models/token2wav_asr", timeout=30).json()
        scored = asyncio.run(compute_score("t", SpeechVocab.codes_to_text(c), text, urls=srv.url,
                                           expect_mos_weight=0.5))
        wrong = RewardClientConfig.from_env(srv.url, mos_weight=0.2)
        wrong.max_fail_fraction, wrong.retries = 1.0, 0
        refused = asyncio.run(compute_score("t", SpeechVocab.codes_to_text(c), text, config=wrong))
    ovrl = got[MOS_OUTPUT]
    assert 0.5 < ovrl < 5.5 and got["ERROR_RATES"] == cer_only["ERROR_RATES"]
    assert got["REWARDS"] == pytest.approx(cer_only["REWARDS"] + 0.5 * naturalness_term(ovrl), abs=1e-12)
    assert got["REWARDS"] > cer_only["REWARDS"]  # the tiny model's noise still scores above OVRL 1 (about 1.08)
    pipe = SpeechPipeline(t2w, SimASR(), want_mos=True)  # the same audio scored here: the same OVRL
    assert pipe.transcribe_tokens([c], [text])[0].mos.ovrl == pytest.approx(ovrl, abs=1e-4)
    assert empty["REWARDS"] == 0.0 and math.isnan(empty[MOS_OUTPUT])
    assert meta["mos_weight"] == 0.5 and meta["measures_mos"] is True and meta["reward_range"] == [0.0, 1.5]
    assert scored["mos"] == pytest.approx(ovrl) and scored["mos_measured"] == 1.0
    assert scored["score"] == pytest.approx(got["REWARDS"]) and scored["reward_failed"] == 0.0
    assert refused["reward_failed"] == 1.0 and refused["score"] == 0.0
