"""The reward server on a real loopback port with the sim backend."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers import start_reward_server, stop_process

from ttsrl.embedded import codec
from ttsrl.families import family  # noqa: E402
from ttsrl.reward.backends import SpeakerPrompt, SpeechPipeline
from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
from ttsrl.reward.server import BackgroundServer, ServerConfig
from ttsrl.text import normalize

SPEECH_TOKEN_SIZE = family("cosyvoice2").speech_token_size  # the family these tests run

ROOT = Path(__file__).resolve().parents[1]
MODEL = "token2wav_asr"
TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。"]
MAX_TOKENS = 2000
MAX_BODY = 100_000


@pytest.fixture(scope="module")
def server_url():
    """The CLI, as a user starts it, on a free port (it prints the port when ready)."""
    proc, url = start_reward_server("--backend", "sim", "--max-batch", "32", "--max-delay-ms", "20",
                                    "--max-tokens", str(MAX_TOKENS), "--max-body-bytes", str(MAX_BODY),
                                    "--log-level", "WARNING")
    yield url
    stop_process(proc)


def reference_payload(tokens: list[int], gt_text: str) -> dict:
    """Built exactly like the reference recipe's client (numpy int32 [1,N], .tolist())."""
    tokens_arr = np.array(tokens, dtype=np.int32).reshape(1, -1)
    lens_arr = np.array([[tokens_arr.shape[1]]], dtype=np.int32)
    return {"inputs": [
        {"name": "TOKENS", "shape": list(tokens_arr.shape), "datatype": "INT32", "data": tokens_arr.tolist()},
        {"name": "TOKEN_LENS", "shape": list(lens_arr.shape), "datatype": "INT32", "data": lens_arr.tolist()},
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [gt_text]},
    ]}


def post(url, payload, **kw):
    return requests.post(f"{url}/v2/models/{MODEL}/infer", headers={"Content-Type": "application/json"},
                         json=payload, timeout=60, **kw)


def stats(url):
    return requests.get(f"{url}/v2/models/{MODEL}/stats", timeout=10).json()


def test_reference_request_scores_correct_speech_high_and_garbage_low(server_url):
    for text in TEXTS:
        rsp = post(server_url, reference_payload(codec.encode(text), text), params={"request_id": "0"})
        assert rsp.status_code == 200, rsp.text
        result = rsp.json()
        # the reference client reads outputs[0].data[0] as the reward
        assert result["outputs"][0]["name"] == "REWARDS"
        assert float(result["outputs"][0]["data"][0]) == pytest.approx(1.0, abs=1e-6)
        outs = {o["name"]: o for o in result["outputs"]}
        assert outs["TRANSCRIPTS"]["datatype"] == "BYTES" and outs["TRANSCRIPTS"]["shape"] == [1, 1]
        assert outs["TRANSCRIPTS"]["data"][0] == codec.decode(codec.encode(text))
        assert outs["ERROR_RATES"]["data"][0] == 0.0
    rng = np.random.default_rng(0)
    garbage = rng.integers(0, SPEECH_TOKEN_SIZE, size=40).tolist()
    r = post(server_url, reference_payload(garbage, TEXTS[0])).json()
    assert r["outputs"][0]["data"][0] < 0.2
    # a wrong sentence's correct speech scores low too
    r = post(server_url, reference_payload(codec.encode(TEXTS[1]), TEXTS[0])).json()
    assert r["outputs"][0]["data"][0] < 0.3


def test_flat_data_and_versioned_route_and_requested_outputs(server_url):
    codes = codec.encode(TEXTS[1])
    payload = {"id": "abc", "inputs": [
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [TEXTS[1]]},
        {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": codes},
        {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [len(codes)]},
    ], "outputs": [{"name": "REWARDS"}]}
    r = requests.post(f"{server_url}/v2/models/{MODEL}/versions/1/infer", json=payload, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "abc" and [o["name"] for o in body["outputs"]] == ["REWARDS"]
    assert body["outputs"][0]["data"][0] == pytest.approx(1.0)
    # GT_TEXT as base64 bytes
    payload["inputs"][0]["data"] = [{"b64": base64.b64encode(TEXTS[1].encode()).decode()}]
    assert requests.post(f"{server_url}/v2/models/{MODEL}/infer", json=payload,
                         timeout=30).json()["outputs"][0]["data"][0] == pytest.approx(1.0)


def test_token_lens_shorter_than_tokens_uses_the_prefix(server_url):
    codes = codec.encode(TEXTS[1])
    p = reference_payload(codes + codec.encode(TEXTS[0]), TEXTS[1])
    p["inputs"][1]["data"] = [[len(codes)]]
    assert post(server_url, p).json()["outputs"][0]["data"][0] == pytest.approx(1.0)


def test_empty_tokens_score_zero(server_url):
    rsp = post(server_url, reference_payload([], TEXTS[0]))
    assert rsp.status_code == 200, rsp.text
    outs = {o["name"]: o["data"][0] for o in rsp.json()["outputs"]}
    assert outs["REWARDS"] == 0.0 and outs["TRANSCRIPTS"] == ""


def test_health_and_metadata(server_url):
    assert requests.get(f"{server_url}/v2/health/live", timeout=5).status_code == 200
    assert requests.get(f"{server_url}/v2/health/ready", timeout=5).status_code == 200
    assert requests.get(f"{server_url}/v2/models/{MODEL}/ready", timeout=5).status_code == 200
    meta = requests.get(f"{server_url}/v2/models/{MODEL}", timeout=5).json()
    assert meta["name"] == MODEL
    assert [i["name"] for i in meta["inputs"]] == ["TOKENS", "TOKEN_LENS", "GT_TEXT", "PROMPT_ID", "FINISHED"]
    assert [i.get("optional", False) for i in meta["inputs"]] == [False, False, False, True, True]  # PROMPT_ID, FINISHED
    assert [o["name"] for o in meta["outputs"]][:2] == ["REWARDS", "TRANSCRIPTS"]
    r = requests.get(f"{server_url}/v2/models/other", timeout=5)
    assert r.status_code == 404 and "unknown model" in r.json()["error"]


def test_concurrent_requests_are_batched(server_url):
    before = stats(server_url)
    n = 64
    jobs = [(codec.encode(TEXTS[i % len(TEXTS)]), TEXTS[i % len(TEXTS)]) for i in range(n)]
    barrier = threading.Barrier(n)

    def one(job):
        barrier.wait()
        return post(server_url, reference_payload(*job))

    with ThreadPoolExecutor(n) as pool:
        rsps = list(pool.map(one, jobs))
    assert all(r.status_code == 200 for r in rsps)
    assert all(r.json()["outputs"][0]["data"][0] == pytest.approx(1.0) for r in rsps)
    after = stats(server_url)
    assert after["items"] - before["items"] == n
    assert after["batches"] - before["batches"] < n  # some requests shared a batch
    new_sizes = {int(k): v - before["batch_size_histogram"].get(k, 0)
                 for k, v in after["batch_size_histogram"].items()}
    assert max(k for k, v in new_sizes.items() if v > 0) > 1
    assert after["max_batch_size"] <= 32


def _malformed_requests():
    """(description, body bytes or dict, extra kwargs) — 100 bad requests."""
    good = reference_payload(codec.encode(TEXTS[0]), TEXTS[0])

    def mutate(fn):
        p = json.loads(json.dumps(good))
        fn(p)
        return p

    def inp(p, name):
        return next(i for i in p["inputs"] if i["name"] == name)

    cases = []
    # bodies that are not JSON or not the right JSON
    for body in [b"", b"{", b"not json", b"\xff\xfe\x00", b"[]", b"null", b"42", b'"x"', b"{}",
                 b'{"inputs": {}}', b'{"inputs": []}', b'{"inputs": [1, 2, 3]}', b'{"inputs": [{"data": []}]}']:
        cases.append(("raw body", body))
    # missing / unknown / duplicate inputs
    for name in ("TOKENS", "TOKEN_LENS", "GT_TEXT"):
        cases.append((f"missing {name}", mutate(lambda p, n=name: p["inputs"].remove(inp(p, n)))))
    cases.append(("unknown input", mutate(lambda p: p["inputs"].append(
        {"name": "EXTRA", "shape": [1, 1], "datatype": "INT32", "data": [[1]]}))))
    cases.append(("duplicate", mutate(lambda p: p["inputs"].append(dict(inp(p, "TOKENS"))))))
    cases.append(("input without name", mutate(lambda p: inp(p, "TOKENS").pop("name"))))
    # wrong datatypes
    for dt in ("INT64", "FP32", "BYTES", "int32", None, 5):
        cases.append((f"TOKENS dtype {dt}", mutate(lambda p, d=dt: inp(p, "TOKENS").__setitem__("datatype", d))))
    for dt in ("INT64", "FP32", "BYTES"):
        cases.append((f"LENS dtype {dt}", mutate(lambda p, d=dt: inp(p, "TOKEN_LENS").__setitem__("datatype", d))))
    for dt in ("INT32", "STRING", None):
        cases.append((f"GT dtype {dt}", mutate(lambda p, d=dt: inp(p, "GT_TEXT").__setitem__("datatype", d))))
    # wrong shapes
    n = len(inp(good, "TOKENS")["data"][0])
    for shape in ([n], [2, n], [1, n, 1], [1, n + 1], [1, n - 1], [1, -1], "1,n", [1.0, n], None, [True, n]):
        cases.append((f"TOKENS shape {shape}", mutate(lambda p, s=shape: inp(p, "TOKENS").__setitem__("shape", s))))
    for shape in ([1, 2], [2, 1], [], [1, 1, 1]):
        cases.append((f"LENS shape {shape}", mutate(lambda p, s=shape: inp(p, "TOKEN_LENS").__setitem__("shape", s))))
    for shape in ([1, 2], [2, 1], []):
        cases.append((f"GT shape {shape}", mutate(lambda p, s=shape: inp(p, "GT_TEXT").__setitem__("shape", s))))
    # bad data values
    for data in ([[1.5] * n], [["7"] * n], [[None] * n], [[True] * n], "abc", {"a": 1}, [[[[1]]]],
                 [[2 ** 40] * n]):
        cases.append((f"TOKENS data {str(data)[:20]}", mutate(lambda p, d=data: inp(p, "TOKENS").__setitem__("data", d))))
    cases.append(("TOKENS no data", mutate(lambda p: inp(p, "TOKENS").pop("data"))))
    cases.append(("TOKENS ragged", mutate(lambda p: inp(p, "TOKENS").__setitem__("data", [[1, 2], [3]]))))
    cases.append(("TOKENS shape [0, n]", mutate(lambda p: inp(p, "TOKENS").__setitem__("shape", [0, n]))))
    cases.append(("TOKENS no shape", mutate(lambda p: inp(p, "TOKENS").pop("shape"))))
    cases.append(("GT no data", mutate(lambda p: inp(p, "GT_TEXT").pop("data"))))
    for bad in (SPEECH_TOKEN_SIZE, SPEECH_TOKEN_SIZE + 3, 151663, -1, -6561, 2 ** 31 - 1):
        cases.append((f"id {bad}", mutate(lambda p, b=bad: inp(p, "TOKENS")["data"][0].__setitem__(3, b))))
    for pos in (0, -1):  # out of range at the ends too
        cases.append((f"id -1 at {pos}", mutate(lambda p, i=pos: inp(p, "TOKENS")["data"][0].__setitem__(i, -1))))
        cases.append((f"id 6561 at {pos}", mutate(
            lambda p, i=pos: inp(p, "TOKENS")["data"][0].__setitem__(i, SPEECH_TOKEN_SIZE))))
    # TOKEN_LENS mismatches
    for lens in ([[n + 1]], [[-1]], [[10 ** 6]], [[1.0]], [["3"]], [[n, n]], [], [[None]]):
        cases.append((f"LENS {lens}", mutate(lambda p, v=lens: inp(p, "TOKEN_LENS").__setitem__("data", v))))
    # GT_TEXT contents
    for data in ([""], ["   "], [None], [5], [["a", "b"]], ["a", "b"], [], [{"b64": "!!!"}],
                 [{"b64": base64.b64encode(b"\xff\xfe\xfd").decode()}], [{"b64": base64.b64encode(b"\xc3").decode()}],
                 [{"b64": 5}], [{"x": "y"}], ["字" * 5000]):
        cases.append((f"GT data {str(data)[:20]}", mutate(lambda p, d=data: inp(p, "GT_TEXT").__setitem__("data", d))))
    lone = json.dumps(good).replace(json.dumps(TEXTS[0]), '"\\ud800abc"').encode()
    cases.append(("GT lone surrogate", lone))
    # other top-level fields
    cases.append(("outputs not a list", mutate(lambda p: p.__setitem__("outputs", "REWARDS"))))
    cases.append(("unknown output", mutate(lambda p: p.__setitem__("outputs", [{"name": "LOGITS"}]))))
    cases.append(("id not a string", mutate(lambda p: p.__setitem__("id", 5))))
    # size limits (413)
    big = list(range(MAX_TOKENS + 1))
    cases.append(("too many tokens", reference_payload([c % 100 for c in big], TEXTS[0])))
    cases.append(("body too large", json.dumps(good).encode() + b" " * MAX_BODY))
    return cases


def test_malformed_requests_get_4xx_with_a_message(server_url):
    cases = _malformed_requests()
    extra = []
    # routes/methods/models that do not exist
    extra.append(("wrong model", requests.post(f"{server_url}/v2/models/nope/infer",
                                               json=reference_payload([1, 2], "你好"), timeout=10)))
    extra.append(("wrong version", requests.post(f"{server_url}/v2/models/{MODEL}/versions/9/infer",
                                                 json=reference_payload([1, 2], "你好"), timeout=10)))
    extra.append(("GET infer", requests.get(f"{server_url}/v2/models/{MODEL}/infer", timeout=10)))
    extra.append(("no route", requests.post(f"{server_url}/v2/models/{MODEL}/explain", json={}, timeout=10)))
    assert len(cases) + len(extra) >= 100, len(cases) + len(extra)
    before = stats(server_url)
    for desc, body in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(f"{server_url}/v2/models/{MODEL}/infer", data=data,
                          headers={"Content-Type": "application/json"}, timeout=30)
        extra.append((desc, r))
    for desc, r in extra:
        assert 400 <= r.status_code < 500, (desc, r.status_code, r.text[:200])
        msg = r.json().get("error")
        assert isinstance(msg, str) and msg, (desc, r.text[:200])
    codes = {desc: r.status_code for desc, r in extra}
    assert codes["too many tokens"] == 413 and codes["body too large"] == 413
    assert codes["wrong model"] == 404
    assert "6560" in dict(extra)["id 6561"].json()["error"]
    # still healthy, still correct
    assert requests.get(f"{server_url}/v2/health/ready", timeout=5).status_code == 200
    r = post(server_url, reference_payload(codec.encode(TEXTS[2]), TEXTS[2]))
    assert r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
    after = stats(server_url)
    assert after["client_errors"] - before["client_errors"] >= len(cases)
    assert after["backend_errors"] == before["backend_errors"]


class SlowSim(SimToken2Wav):
    """The sim codec with a fixed delay per batch, to fill the queue."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def synthesize(self, batch, prompts):
        time.sleep(self.delay_s)
        return super().synthesize(batch, prompts)


def test_full_queue_answers_503_with_retry_after():
    cfg = ServerConfig(port=0, max_batch=1, max_delay_ms=0, max_queue=2)
    pipe = SpeechPipeline(SlowSim(0.25), SimASR())
    with BackgroundServer(cfg, pipelines=[pipe]) as srv:
        n = 12
        barrier = threading.Barrier(n)

        def one(i):
            barrier.wait()
            return post(srv.url, reference_payload(codec.encode(TEXTS[i % 4]), TEXTS[i % 4]))

        with ThreadPoolExecutor(n) as pool:
            rsps = list(pool.map(one, range(n)))
        full = [r for r in rsps if r.status_code == 503]
        ok = [r for r in rsps if r.status_code == 200]
        assert full and ok and len(full) + len(ok) == n
        for r in full:
            assert r.headers.get("Retry-After") == "1"
            assert "queue full" in r.json()["error"]
        s = stats(srv.url)
        assert s["rejected_queue_full"] == len(full) and s["max_queue_depth"] <= 2
        assert requests.get(f"{srv.url}/v2/health/ready", timeout=5).status_code == 200


class ThreeVoices(SimToken2Wav):
    @property
    def prompts(self):
        return tuple(SpeakerPrompt(f"v{i}") for i in range(3))


def test_speaker_prompt_is_fixed_per_text():
    pipe = SpeechPipeline(ThreeVoices(), SimASR())
    chosen = {}
    for text in TEXTS * 3:
        p = pipe.prompt_for(text)
        assert chosen.setdefault(text, p.name) == p.name
        digest = hashlib.sha1(normalize(text).encode()).digest()
        assert p.name == f"v{int.from_bytes(digest[:8], 'big') % 3}"
    # texts that normalise the same get the same speaker
    assert pipe.prompt_for("我想喝一杯热茶。") == pipe.prompt_for("我想喝一杯热茶")
    tr = pipe.transcribe_tokens([codec.encode(TEXTS[0]), []], [TEXTS[0], TEXTS[1]])
    assert tr[0].prompt == chosen[TEXTS[0]] and tr[1].text == "" and tr[1].n_tokens == 0


def test_cli_help_explains():
    out = subprocess.run([sys.executable, str(ROOT / "token2wav_asr_server.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env={**os.environ}).stdout
    for flag in ("--backend", "--max-batch", "--max-delay-ms", "--max-queue", "--max-body-bytes", "--max-tokens",
                 "--host", "--reward"):
        assert flag in out
