"""One scoring path and one wire protocol: the reward server and the
evaluator score alike; the protocol module round-trips; backend options are shared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from ttsrl.data.testsets import Utterance
from ttsrl.embedded import codec
from ttsrl.eval.evaluate import score
from ttsrl.families import family
from ttsrl.model.generate import Generated
from ttsrl.reward.backends import BackendConfig, SpeechPipeline, build_pipeline
from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
from ttsrl.reward.infer_request import parse_infer
from ttsrl.reward.protocol import (
    INPUT_SPECS,
    OUTPUT_SPECS,
    ResponseError,
    build_payload,
    build_response,
    infer_path,
    model_metadata,
    parse_response,
)
from ttsrl.reward.scoring import NO_CODES, result_row, score_codes
from ttsrl.reward.server import BackgroundServer, ServerConfig
from ttsrl.text import error_counts

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。"]


def _cases():
    """Exact, slightly wrong, far too long and empty speech for each text."""
    out = []
    for t in TEXTS:
        codes = codec.encode(t)
        out += [(codes, t), (codes[:-4], t), (codes * 4, t), ([], t)]
    return out


@pytest.mark.parametrize("reward", ["tanh", "toneless"])
def test_server_and_evaluator_give_the_same_rewards(reward):
    cases = _cases()
    pipeline = build_pipeline(BackendConfig(backend="sim"))
    rows = score(pipeline, [Utterance(f"u{i}", t) for i, (_, t) in enumerate(cases)],
                 [Generated(codes=list(c)) for c, _ in cases], reward=reward)
    with BackgroundServer(ServerConfig(port=0, reward=reward)) as srv:
        served = []
        for codes, text in cases:
            r = requests.post(srv.url + infer_path(), json=build_payload(codes, text), timeout=30)
            assert r.status_code == 200, r.text
            served.append(parse_response(r.json()))
    assert len({round(x[0], 6) for x in served}) > 3  # the cases really differ
    for (reward_s, _, transcript_s, *_), row in zip(served, rows):
        assert row["reward"] == pytest.approx(reward_s, abs=1e-12)
        assert row["transcript"] == transcript_s


class ToneSyllableASR(SimASR):
    """An ASR (not named "sim") that writes toned pinyin, like the simulated one."""

    name = "pinyin-writer"
    transcript_unit = "pinyin"


class CharASR(SimASR):
    name = "sim"  # the name no longer decides anything
    transcript_unit = "char"


def test_failure_unit_comes_from_the_backend_not_its_name():
    text = "我有2个苹果"  # 6 characters normalised ("我有两个苹果"), 6 syllables; "2" -> 两
    utts = [Utterance("a", text)]
    gens = [Generated(codes=[])]
    pinyin_rows = score(SpeechPipeline(SimToken2Wav(), ToneSyllableASR()), utts, gens)
    char_rows = score(SpeechPipeline(SimToken2Wav(), CharASR()), utts, gens)
    assert pinyin_rows[0]["ref_len"] == error_counts(text, "", "pinyin")[1]
    assert char_rows[0]["ref_len"] == error_counts(text, "", "char")[1]
    english = "hello world"  # 11 chars with the space, 2 pinyin tokens: the units differ
    rows = [score(SpeechPipeline(SimToken2Wav(), asr), [Utterance("e", english)], gens)[0]
            for asr in (ToneSyllableASR(), CharASR())]
    assert rows[0]["ref_len"] == 2 and rows[1]["ref_len"] == 11


def test_score_codes_marks_empty_speech_as_failure():
    pipeline = build_pipeline(BackendConfig(backend="sim"))
    out = score_codes(pipeline, [codec.encode(TEXTS[0]), []], TEXTS[:2])
    assert out[0].failure is None and out[0].reward == pytest.approx(1.0)
    assert out[1].failure and out[1].reward == 0.0 and out[1].error_rate == 1.0 and out[1].transcript == ""


def test_the_result_row_of_a_success_and_of_each_failure_comes_from_scoring():
    """scoring.result_row owns the row: the evaluator's rows are exactly its columns, for a
    scored utterance, empty speech, and a generation error (which wins over the codes)."""
    pipeline = build_pipeline(BackendConfig(backend="sim"))
    text = TEXTS[0]
    codes = codec.encode(text)
    good, empty = score_codes(pipeline, [codes, []], [text, text])
    ok = result_row(pipeline, text, len(codes), good)
    assert ok["failure"] is False and ok["error"] is None and ok["reward"] == pytest.approx(1.0)
    assert ok["transcript"] == good.transcript and ok["cer_errors"] == 0 and ok["length_ratio"] > 0
    for scored, error, why in [(empty, None, NO_CODES), (None, None, NO_CODES), (None, "CUDA out of memory", "CUDA out of memory"),
                               (good, "timeout", "timeout")]:
        row = result_row(pipeline, text, 0 if scored is not good else len(codes), scored, error)
        n = error_counts(text, "", pipeline.failure_unit)[1]
        assert row == {"length_ratio": None, "transcript": "", "cer_errors": n, "ref_len": n,
                       "pinyin_errors": error_counts(text, "", "pinyin")[1],
                       "pinyin_ref_len": error_counts(text, "", "pinyin")[1], "reward": 0.0, "failure": True,
                       "sim": None, "mos_ovrl": None, "mos_sig": None, "mos_bak": None, "reading_errors": None,
                       "reading_ref_len": None, "reading_error": None, "error": why}
    rows = score(pipeline, [Utterance("a", text), Utterance("b", text)],
                 [Generated(codes=list(codes)), Generated(codes=[], error="CUDA out of memory")])
    for row, expect in zip(rows, [ok, result_row(pipeline, text, 0, None, "CUDA out of memory")]):
        assert {k: row[k] for k in expect} == expect


def test_protocol_round_trip():
    codes, text = [5, 6, 7, 6560], "你好，世界"
    body = json.dumps(build_payload(codes, text)).encode()
    r = parse_infer(body, 4096, speech_token_size=family("cosyvoice2").speech_token_size)
    assert (r.codes, r.text, r.rid, r.wanted) == (codes, text, None, None)
    resp = build_response("m", 0.25, "ni3 hao3", 0.5, rid="x", wanted=["REWARDS", "ERROR_RATES"])
    assert resp["id"] == "x" and [o["name"] for o in resp["outputs"]] == ["REWARDS", "ERROR_RATES"]
    assert parse_response(json.loads(json.dumps(resp)))[:3] == (0.25, 0.5, "")
    full = build_response("m", 0.25, "ni3 hao3", 0.5)
    assert parse_response(full)[:3] == (0.25, 0.5, "ni3 hao3") and math.isnan(parse_response(full).sim)
    measured = build_response("m", 0.25, "ni3 hao3", 0.5, sim=0.75)  # SIMS survives a JSON round trip
    assert parse_response(json.loads(json.dumps(measured)))[:4] == (0.25, 0.5, "ni3 hao3", 0.75)
    # not measured: SIMS left out (the body stays strict JSON), NaN only when asked for by name
    assert [o["name"] for o in full["outputs"]] == ["REWARDS", "TRANSCRIPTS", "ERROR_RATES"]  # the terms: by name only
    json.dumps(full, allow_nan=False)
    asked = build_response("m", 0.25, "", 0.5, wanted=["REWARDS", "SIMS"])["outputs"]
    assert [o["name"] for o in asked] == ["REWARDS", "SIMS"] and math.isnan(asked[1]["data"][0])
    for bad in (1.5, -2.0, math.inf):
        with pytest.raises(ResponseError, match="speaker similarity|output SIMS is inf"):
            parse_response(build_response("m", 0.25, "", 0.5, sim=bad))
    meta = model_metadata("m")
    assert [i["name"] for i in meta["inputs"]] == [n for n, _, _ in INPUT_SPECS] + ["PROMPT_ID", "FINISHED"]
    assert [i.get("optional", False) for i in meta["inputs"]] == [False, False, False, True, True]  # PROMPT_ID, FINISHED
    assert [o["name"] for o in meta["outputs"]][0] == OUTPUT_SPECS[0][0] == "REWARDS"


def _options(script: str) -> set[str]:
    out = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return {w.rstrip(",") for w in out.split() if w.startswith("--")}


@pytest.mark.slow  # every CLI's --help in a subprocess: ~7 s
def test_backend_options_are_shared_by_every_cli():
    import argparse

    from ttsrl.reward.backends.options import add_backend_args

    p = argparse.ArgumentParser()
    add_backend_args(p)
    shared = {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert len(shared) >= 10
    assert shared <= _options("token2wav_asr_server.py")
    assert shared - {"--cpu-threads"} <= _options("infer_dataset.py")  # it sets threads with --threads
