"""The same speaker end to end: the optional PROMPT_ID input of the wire
protocol, the server voicing a rollout with the prompt it names (and measuring SIM against that
prompt wav), the client passing a verl row's ``extra_info["prompt_id"]``.

Protocol tests need no server; the sim backend's CLI (no speakers) must refuse every id; the
speaker tests run a real server on loopback over the random tiny CosyVoice2 folder of
tests/cosyvoice2_tiny.py with its two prompt wavs (spk_a, spk_b): they check that the id picks
the voice (and SIM), not quality.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from ttsrl.embedded import codec
from ttsrl.families import family
from ttsrl.model.vocab import SpeechVocab
from ttsrl.reward.client import RewardClientConfig, RewardServiceError, compute_score, row_prompt_id
from ttsrl.reward.infer_request import RequestError, parse_infer
from ttsrl.reward.protocol import (
    MAX_PROMPT_ID_BYTES,
    ResponseError,
    build_payload,
    build_response,
    infer_path,
    parse_response,
)
from ttsrl.reward.triton_binary import HEADER, attach_inputs, split_body

sys.path.insert(0, str(Path(__file__).parent))

TEXTS = ["你好", "今天天气很好", "我们去散步", "谢谢你", "再见", "早上好", "晚上好", "明天见"]
HAS_TRITONCLIENT = importlib.util.find_spec("tritonclient") is not None
# the server reads requests against its family's speech vocabulary; these are CosyVoice2's
parse = functools.partial(parse_infer, speech_token_size=family("cosyvoice2").speech_token_size)


def codes(n: int, start: int = 0) -> list[int]:
    return [(start + 37 * i) % 6561 for i in range(n)]


def binary_body(c: list[int], text: str, prompt_id: bytes | None) -> tuple[bytes, str]:
    """A request in Triton's binary tensor data extension (what tritonclient sends by default),
    PROMPT_ID's bytes as given; (body, header value)."""
    tok = struct.pack(f"<{len(c)}i", *c)
    gt = text.encode("utf-8")
    inputs = [{"name": "TOKENS", "shape": [1, len(c)], "datatype": "INT32", "parameters": {"binary_data_size": len(tok)}},
              {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "parameters": {"binary_data_size": 4}},
              {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 4 + len(gt)}}]
    raw = tok + struct.pack("<i", len(c)) + struct.pack("<I", len(gt)) + gt
    if prompt_id is not None:
        inputs.append({"name": "PROMPT_ID", "shape": [1, 1], "datatype": "BYTES",
                       "parameters": {"binary_data_size": 4 + len(prompt_id)}})
        raw += struct.pack("<I", len(prompt_id)) + prompt_id
    head = json.dumps({"inputs": inputs}).encode()
    return head + raw, str(len(head))


# ---------------------------------------------------------------------------
# the wire, no server


def test_a_request_without_prompt_id_is_the_reference_body_and_answer():
    """Old clients are unaffected: the body without a prompt id is the reference recipe's, it parses
    to no prompt, and the answer carries no prompt_id."""
    c = codes(5)
    assert build_payload(c, "你好") == build_payload(c, "你好", None) == {"inputs": [
        {"name": "TOKENS", "shape": [1, 5], "datatype": "INT32", "data": [c]},
        {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[5]]},
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["你好"]}]}
    assert parse(json.dumps(build_payload(c, "你好")).encode(), 100).prompt_id is None
    assert parse(*binary_body(c, "你好", None)[:1], 100, binary_body(c, "你好", None)[1]).prompt_id is None
    plain = build_response("m", 0.5, "t", 0.1, reward_name="tanh")
    assert plain == build_response("m", 0.5, "t", 0.1, reward_name="tanh", prompt_id=None)
    assert "prompt_id" not in plain["parameters"]


@pytest.mark.parametrize("how", ["nested", "flat", "shape [1]", "base64", "binary", "unicode"])
def test_prompt_id_is_read_from_json_and_binary_requests(how):
    c, pid = codes(7), "spk_a" if how != "unicode" else "说话人 甲-01"
    body = build_payload(c, "你好", pid)
    spec = body["inputs"][3]
    if how == "flat":
        spec["data"] = [pid]
    elif how == "shape [1]":
        spec["shape"], spec["data"] = [1], [pid]
    elif how == "base64":
        spec["data"] = [{"b64": base64.b64encode(pid.encode()).decode()}]
    if how == "binary":
        req = parse(*binary_body(c, "你好", pid.encode())[:1], 100, binary_body(c, "你好", pid.encode())[1])
    else:
        req = parse(json.dumps(body).encode(), 100)
    assert (req.prompt_id, req.codes, req.text) == (pid, c, "你好")


BAD = {
    "datatype INT32": ({"datatype": "INT32", "data": [[1]]}, 400, "datatype must be BYTES"),
    "shape [1, 2]": ({"shape": [1, 2], "data": [["a", "b"]]}, 400, "shape must be [1, 1]"),
    "a number": ({"data": [[7]]}, 400, "expected a string"),
    "bad base64": ({"data": [{"b64": "***"}]}, 400, "invalid base64"),
    "not UTF-8": ({"data": [{"b64": base64.b64encode(b"\xff\xfe").decode()}]}, 400, "not valid UTF-8"),
    "empty": ({"data": [""]}, 400, "is empty"),
    "spaces around": ({"data": [" spk_a"]}, 400, "whitespace"),
    "a path": ({"data": ["../spk_a"]}, 400, "'/'"),
    "a backslash": ({"data": ["a\\b"]}, 400, "'\\\\'"),
    "a control character": ({"data": ["spk\na"]}, 400, "'\\n'"),
    "dot dot": ({"data": [".."]}, 400, "not a file stem"),
    "too long": ({"data": ["甲" * 86]}, 413, f"at most {MAX_PROMPT_ID_BYTES}"),
    "no data": ({"data": None}, 400, "missing 'data'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_prompt_id_is_a_4xx_naming_the_input(case):
    change, status, words = BAD[case]
    body = build_payload(codes(5), "你好", "spk_a")
    spec = body["inputs"][3]
    spec.update(change)
    if spec["data"] is None:
        del spec["data"]
    with pytest.raises(RequestError) as e:
        parse(json.dumps(body).encode(), 100)
    assert e.value.status == status and "PROMPT_ID" in str(e.value) and words in str(e.value), str(e.value)


def test_prompt_id_limits_in_binary_and_twice():
    body, n = binary_body(codes(5), "你好", b"\xff\xfe")
    with pytest.raises(RequestError, match="PROMPT_ID.*not valid UTF-8"):
        parse(body, 100, n)
    ok = "甲" * (MAX_PROMPT_ID_BYTES // 3)  # 255 bytes: the longest id
    assert parse(json.dumps(build_payload(codes(5), "你好", ok)).encode(), 100).prompt_id == ok
    twice = build_payload(codes(5), "你好", "spk_a")
    twice["inputs"].append(dict(twice["inputs"][3]))
    with pytest.raises(RequestError, match="input PROMPT_ID given twice"):
        parse(json.dumps(twice).encode(), 100)
    other = build_payload(codes(5), "你好")
    other["inputs"].append({"name": "SPEAKER", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]})
    with pytest.raises(RequestError, match="unknown input 'SPEAKER'.*optionally PROMPT_ID"):
        parse(json.dumps(other).encode(), 100)


def test_the_client_refuses_an_answer_voiced_by_another_prompt():
    """The answer carries the prompt back; an answer without it (an old server that ignored the
    input) or naming another one is refused, so a wrong speaker never trains silently."""
    good = build_response("m", 0.5, "t", 0.1, prompt_id="spk_a")
    assert good["parameters"]["prompt_id"] == "spk_a"
    assert parse_response(good, prompt_id="spk_a").reward == 0.5
    for answer in (build_response("m", 0.5, "t", 0.1), build_response("m", 0.5, "t", 0.1, prompt_id="spk_b")):
        with pytest.raises(ResponseError, match="not the 'spk_a' asked for"):
            parse_response(answer, prompt_id="spk_a")
    assert parse_response(build_response("m", 0.5, "t", 0.1)).reward == 0.5  # not asked: not checked


def test_row_prompt_id_reads_extra_info():
    assert row_prompt_id(None) is None and row_prompt_id({}) is None and row_prompt_id({"prompt_id": None}) is None
    assert row_prompt_id({"prompt_id": "spk_a", "index": 3}) == "spk_a"
    assert row_prompt_id({"prompt_id": 1002}) == "1002"  # a numeric stem read back as an integer
    for bad in (True, 1.5, ["spk_a"], {"id": "spk_a"}):
        with pytest.raises(ValueError, match="extra_info\\['prompt_id'\\]"):
            row_prompt_id({"prompt_id": bad})


# ---------------------------------------------------------------------------
# the sim backend: no speakers


def test_the_sim_backend_refuses_every_prompt_id(sim_server_url):
    """No prompt pool: 422 naming the id and that the server knows none (JSON and binary); the
    metadata and config list PROMPT_ID as optional and the pool as empty; old requests still work."""
    url = sim_server_url + infer_path()
    text = TEXTS[1]
    r = requests.post(url, json=build_payload(codec.encode(text), text, "spk_a"), timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert "'spk_a'" in err and "knows 0 prompt ids" in err and "backend sim" in err, err
    body, n = binary_body(codec.encode(text), text, b"spk_a")
    r = requests.post(url, data=body, headers={HEADER: n}, timeout=30)
    assert r.status_code == 422 and "'spk_a'" in r.json()["error"]
    r = requests.post(url, json=build_payload(codec.encode(text), text), timeout=30)
    assert r.status_code == 200 and "prompt_id" not in r.json()["parameters"]
    assert r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
    meta = requests.get(f"{sim_server_url}/v2/models/token2wav_asr", timeout=10).json()
    assert meta["inputs"][3] == {"name": "PROMPT_ID", "datatype": "BYTES", "shape": [1, 1], "optional": True}
    assert meta["prompt_ids"] == 0
    cfg = requests.get(f"{sim_server_url}/v2/models/token2wav_asr/config", timeout=10).json()
    assert [(t["name"], t["optional"]) for t in cfg["input"]][3] == ("PROMPT_ID", True)
    assert cfg["parameters"]["prompt_ids"] == {"string_value": "0"}


# ---------------------------------------------------------------------------
# CosyVoice2 (random tiny folder): two speakers

cosyvoice_missing = [why for mod, why in (("cosyvoice.cli.model", "CosyVoice's runtime (cosyvoice-minicpmo)"),
                                          ("hyperpyyaml", "hyperpyyaml"), ("onnx", "onnx"),
                                          ("matcha.utils.audio", "Matcha-TTS (cosyvoice-minicpmo)"))
                     if importlib.util.find_spec(mod.split(".")[0]) is None]
needs_cosyvoice = pytest.mark.skipif(bool(cosyvoice_missing), reason=f"{', '.join(cosyvoice_missing)} not installed "
                                     "(bash scripts/install.sh installs it)")


@pytest.fixture(scope="module")
def t2w(cosyvoice2_folders):
    from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav

    model, prompts = cosyvoice2_folders
    return CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))


def _server(t2w, **cfg):
    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.sim import SimASR
    from ttsrl.reward.server import BackgroundServer, ServerConfig

    return BackgroundServer(ServerConfig(port=0, max_batch=4, **cfg), pipelines=[SpeechPipeline(t2w, SimASR())])


@pytest.fixture(scope="module")
def sim_on(t2w):
    """A loopback server over the tiny CosyVoice2 that measures SIM (--want-sim)."""
    with _server(t2w, want_sim=True) as srv:
        yield srv


def ask(url: str, c: list[int], text: str, prompt_id: str | None = None) -> tuple[dict, dict]:
    """(outputs by name, parameters) of one JSON request."""
    r = requests.post(url + infer_path(), json=build_payload(c, text, prompt_id), timeout=300)
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"][0] for o in r.json()["outputs"]}, r.json()["parameters"]


def by_speaker(t2w) -> dict[str, str]:
    """The text the pipeline assigns to each speaker (without PROMPT_ID)."""
    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.sim import SimASR

    pick = SpeechPipeline(t2w, SimASR())
    found: dict[str, str] = {}
    for text in TEXTS:
        found.setdefault(pick.prompt_for(text).name, text)
    assert sorted(found) == ["spk_a", "spk_b"], found
    return found


@needs_cosyvoice
@pytest.mark.slow  # four CosyVoice2 syntheses and campplus passes on the CPU: ~10-40 s on 2 cores
def test_the_pipeline_voices_the_named_prompt(t2w):
    """Two prompt ids give two waveforms, the same id twice the same one, and the named prompt
    wins over the text's own speaker; an unknown id raises, naming it and the pool's size."""
    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.base import UnknownPromptId
    from ttsrl.reward.backends.sim import SimASR

    assert sorted(t2w.prompt_pool) == ["spk_a", "spk_b"]
    assert Path(t2w.prompt_pool["spk_b"].data["wav"]).name == "spk_b.wav"
    texts = by_speaker(t2w)
    pipe = SpeechPipeline(t2w, SimASR(), want_sim=True)
    c = codes(20, 11)
    a, b, a2, own = pipe.transcribe_tokens([c] * 4, [texts["spk_b"]] * 4, prompt_ids=["spk_a", "spk_b", "spk_a", None])
    assert [t.prompt for t in (a, b, a2, own)] == ["spk_a", "spk_b", "spk_a", "spk_b"]
    assert np.array_equal(a.audio.waveform, a2.audio.waveform) and a.sim == a2.sim
    assert not np.array_equal(a.audio.waveform, b.audio.waveform) and abs(a.sim - b.sim) > 1e-3
    assert np.array_equal(b.audio.waveform, own.audio.waveform) and b.sim == own.sim  # the same features
    # SIM is against the named prompt's embedding (campplus of its wav)
    assert a.sim == pytest.approx(t2w.speaker_similarity([a.audio], [t2w.prompt_pool["spk_a"]])[0])
    with pytest.raises(UnknownPromptId, match="'spk_c'.*knows 2 prompt ids.*'spk_a', 'spk_b'"):
        pipe.transcribe_tokens([c], ["你好"], prompt_ids=["spk_c"])


@needs_cosyvoice
def test_the_server_voices_and_judges_with_the_prompt_it_is_given(t2w, sim_on):
    """On loopback: PROMPT_ID picks the speaker (SIM follows it, the same id twice answers the
    same), the answer names it; a request without it is answered exactly as before (by the text's
    speaker, no prompt_id); an unknown id is a 422 naming it and the pool's size, never queued."""
    texts = by_speaker(t2w)
    c = codes(24, 5)
    url = sim_on.url
    old, old_params = ask(url, c, texts["spk_a"])
    assert "prompt_id" not in old_params and set(old) == {"REWARDS", "TRANSCRIPTS", "ERROR_RATES", "SIMS"}
    a, pa = ask(url, c, texts["spk_b"], "spk_a")  # the text's own speaker is spk_b: the id wins
    a2, _ = ask(url, c, texts["spk_b"], "spk_a")
    b, pb = ask(url, c, texts["spk_b"], "spk_b")
    assert pa["prompt_id"] == "spk_a" and pb["prompt_id"] == "spk_b"
    assert a == a2 and abs(a["SIMS"] - b["SIMS"]) > 1e-3
    assert a["SIMS"] == old["SIMS"]  # spk_a's voice, whether named or chosen from the text
    assert b == ask(url, c, texts["spk_b"])[0]  # naming the text's own speaker changes nothing
    assert ask(url, c, texts["spk_a"])[0] == old  # old requests: the same answers, again
    r = requests.post(url + infer_path(), json=build_payload(c, texts["spk_a"], "spk_c"), timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert "PROMPT_ID" in err and "'spk_c'" in err and "knows 2 prompt ids" in err, err
    # binary tensor data (inputs and outputs) gives the JSON answer
    body, n = binary_body(c, texts["spk_b"], b"spk_a")
    head = json.loads(body[:int(n)])
    head["parameters"] = {"binary_data_output": True}
    h = json.dumps(head).encode()
    r = requests.post(url + infer_path(), data=h + body[int(n):], headers={HEADER: str(len(h))}, timeout=300)
    assert r.status_code == 200, r.text
    j, raw = split_body(r.content, r.headers[HEADER])
    outs = json.loads(j)["outputs"]
    attach_inputs(outs, raw)
    got = {o["name"]: o["data"][0] for o in outs}
    assert json.loads(j)["parameters"]["prompt_id"] == "spk_a"
    assert got["SIMS"] == pytest.approx(a["SIMS"], abs=1e-6) and got["REWARDS"] == pytest.approx(a["REWARDS"], abs=1e-6)
    meta = requests.get(f"{url}/v2/models/token2wav_asr", timeout=30).json()
    from ttsrl.reward.backends.base import prompt_pool_sha1

    assert meta["prompt_ids"] == 2 and meta["prompt_pool_sha1"] == prompt_pool_sha1(["spk_b", "spk_a"])
    from ttsrl.reward.health import identity_problem

    assert identity_problem(url, {"prompt_pool": prompt_pool_sha1(["spk_a", "spk_b"])}) is None
    assert "prompt_pool" in identity_problem(url, {"prompt_pool": prompt_pool_sha1(["spk_a"])})
    stats = requests.get(f"{url}/v2/models/token2wav_asr/stats", timeout=30).json()
    assert stats["backend_errors"] == 0 and stats["server_errors"] == 0


@needs_cosyvoice
@pytest.mark.skipif(not HAS_TRITONCLIENT, reason="tritonclient is not installed")
def test_tritonclient_sends_prompt_id(t2w, sim_on):
    """NVIDIA's tritonclient.http with the optional input, binary (its default) and JSON."""
    import tritonclient.http as http

    texts = by_speaker(t2w)
    c = codes(24, 5)
    want, _ = ask(sim_on.url, c, texts["spk_a"], "spk_b")
    client = http.InferenceServerClient(sim_on.url.removeprefix("http://"))
    try:
        for binary in (True, False):
            ins = [http.InferInput("TOKENS", [1, len(c)], "INT32"), http.InferInput("TOKEN_LENS", [1, 1], "INT32"),
                   http.InferInput("GT_TEXT", [1, 1], "BYTES"), http.InferInput("PROMPT_ID", [1, 1], "BYTES")]
            ins[0].set_data_from_numpy(np.array([c], dtype=np.int32), binary_data=binary)
            ins[1].set_data_from_numpy(np.array([[len(c)]], dtype=np.int32), binary_data=binary)
            ins[2].set_data_from_numpy(np.array([[texts["spk_a"].encode()]], dtype=np.object_), binary_data=binary)
            ins[3].set_data_from_numpy(np.array([[b"spk_b"]], dtype=np.object_), binary_data=binary)
            got = client.infer("token2wav_asr", ins)
            assert got.get_response()["parameters"]["prompt_id"] == "spk_b"
            assert float(got.as_numpy("SIMS")[0, 0]) == pytest.approx(want["SIMS"], abs=1e-6)
            assert float(got.as_numpy("REWARDS")[0, 0]) == pytest.approx(want["REWARDS"], abs=1e-6)
            ins[3].set_data_from_numpy(np.array([[b"spk_z"]], dtype=np.object_), binary_data=binary)
            with pytest.raises(http.InferenceServerException) as e:
                client.infer("token2wav_asr", ins)
            assert e.value.status() == "422" and "'spk_z'" in e.value.message()
    finally:
        client.close()


@needs_cosyvoice
def test_compute_score_passes_the_rows_prompt_id(t2w, sim_on):
    """verl's reward function sends extra_info's prompt_id: the score and SIM are those of that
    speaker; a row without one is scored as before; an unknown id is a refused request naming it."""
    texts = by_speaker(t2w)
    c = codes(16, 3)
    text = texts["spk_a"]
    cfg = RewardClientConfig(url=sim_on.url)

    def score(extra_info, config=cfg):
        return asyncio.run(compute_score("t", SpeechVocab.codes_to_text(c), text, extra_info, config=config))

    for pid in ("spk_a", "spk_b"):
        want, _ = ask(sim_on.url, c, text, pid)
        got = score({"prompt_id": pid, "index": 0})
        assert got["sim"] == pytest.approx(want["SIMS"]) and got["score"] == pytest.approx(want["REWARDS"])
        assert got["sim_measured"] == 1.0 and got["reward_failed"] == 0.0
    assert score({"prompt_id": "spk_b"})["sim"] != score({"prompt_id": "spk_a"})["sim"]
    plain = score({"index": 0})
    assert plain == score(None) == score({"prompt_id": None})
    assert set(plain) == set(score({"prompt_id": "spk_a"}))  # the same keys for every row (verl's columns)
    assert plain["sim"] == pytest.approx(ask(sim_on.url, c, text)[0]["SIMS"])
    strict = RewardClientConfig(url=sim_on.url, max_fail_fraction=0.0)
    with pytest.raises(RewardServiceError, match="'spk_c'"):
        score({"prompt_id": "spk_c"}, strict)


@needs_cosyvoice
def test_a_pool_whose_token_file_names_a_missing_wav_is_refused_at_start(t2w, tmp_path):
    """The prompt folder's prompt_speech_tokens.jsonl (scripts/prompt_tokens.py) must name only its
    wavs' stems: rows built from it could carry ids the server cannot voice."""
    from ttsrl.reward.backends import BackendConfig

    def backend(folder):
        return BackendConfig(backend="cosyvoice2", cosyvoice_model_dir=t2w.cfg.model_dir, prompt_dir=str(folder))

    (tmp_path / "prompt_speech_tokens.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt_speech_tokens": [1, 2]}) + "\n" for i in ("spk_a", "spk_c")))
    with pytest.raises(ValueError, match="1 prompt id\\(s\\) with no wav.*'spk_c'"):
        with _server(t2w, backend=backend(tmp_path)):
            pass
    (tmp_path / "prompt_speech_tokens.jsonl").write_text(json.dumps({"id": "spk_b", "prompt_speech_tokens": [1]}))
    with _server(t2w, backend=backend(tmp_path)) as srv:
        assert ask(srv.url, codes(8), "你好", "spk_b")[1]["prompt_id"] == "spk_b"


@needs_cosyvoice
def test_verl_hands_each_rows_prompt_id_to_the_server(t2w, sim_on, monkeypatch):
    """verl 0.9.1's own reward manager (NaiveRewardManager, what the reward loop runs) calls
    reward_tts.py's compute_score with each row's extra_info: each row is voiced by its own prompt
    and its SIM comes back as its ``sim``; a row without a prompt id is voiced as before."""
    pytest.importorskip("verl", reason="verl is not installed")
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from ttsrl.embedded.tiny_tokenizer import train_tokenizer
    from ttsrl.model.vocab import extend_tokenizer
    from ttsrl.reward.client import ENV_URL

    tok = train_tokenizer(TEXTS * 5, 300)
    sv = extend_tokenizer(tok, "cosyvoice2")
    monkeypatch.setenv(ENV_URL, sim_on.url)
    root = Path(__file__).resolve().parent.parent
    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(root / "reward_tts.py"), "name": "compute_score", "reward_kwargs": {}}}})
    manager = NaiveRewardManager(config, tok, get_custom_reward_fn(config))
    c, text = codes(16, 7), TEXTS[2]
    rows = [{"index": 0, "prompt_id": "spk_b"}, {"index": 1, "prompt_id": "spk_a"}, {"index": 2}]
    ids = sv.codes_to_ids(c) + [sv.eos_id]
    n, prompt_len = len(rows), 4
    mask = torch.ones(n, prompt_len + len(ids), dtype=torch.long)
    data = DataProto.from_dict(
        tensors={"prompts": torch.zeros(n, prompt_len, dtype=torch.long),
                 "responses": torch.tensor([ids] * n), "attention_mask": mask},
        non_tensors={"data_source": np.array(["tts"] * n, dtype=object),
                     "reward_model": np.array([{"ground_truth": text}] * n, dtype=object),
                     "extra_info": np.array(rows, dtype=object)})

    async def step():  # what RewardLoopWorker.compute_score_batch does
        return await asyncio.gather(*(manager.run_single(data[i:i + 1]) for i in range(n)))

    outs = manager.loop.run_until_complete(step())
    want = [ask(sim_on.url, c, text, r.get("prompt_id"))[0] for r in rows]
    for o, w in zip(outs, want):
        assert o["reward_extra_info"]["sim"] == pytest.approx(w["SIMS"])
        assert o["reward_score"] == pytest.approx(w["REWARDS"])
    assert abs(outs[0]["reward_extra_info"]["sim"] - outs[1]["reward_extra_info"]["sim"]) > 1e-3


def test_a_bad_pool_given_to_the_server_is_one_message_and_exit_2(tmp_path):
    """The server started by hand with a pool of a bad line printed PoolError's FILE:LINE inside a 50-line
    traceback; now it prints that one message and exits 2."""
    import subprocess

    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "prompt_speech_tokens.jsonl").write_text('{"id": "a\\tb", "prompt_speech_tokens": [1]}\n', encoding="utf-8")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "token2wav_asr_server.py"),
                        "--backend", "sim", "--prompt-dir", str(pool), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"reward server: cannot start: prompt pool {pool}: 1 problem(s):"), r.stderr
    assert f"{pool / 'prompt_speech_tokens.jsonl'}:1: \"id\" 'a\\tb'" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 2
