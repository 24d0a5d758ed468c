"""NVIDIA's own ``tritonclient.http`` against the reward server CLI on a loopback port:
binary tensor data on (the client's default) and off give the same
rewards, transcripts and error rates as the plain JSON path."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.http as http

from ttsrl.embedded import codec
from ttsrl.families import family  # noqa: E402
from ttsrl.reward.protocol import DEFAULT_MODEL_NAME, build_payload, infer_path, parse_response

SPEECH_TOKEN_SIZE = family("cosyvoice2").speech_token_size  # the family these tests run

TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。"]


def _cases() -> list[tuple[list[int], str]]:
    garbage = np.random.default_rng(0).integers(0, SPEECH_TOKEN_SIZE, size=40).tolist()
    return ([(codec.encode(t), t) for t in TEXTS] + [(garbage, TEXTS[0]), (codec.encode(TEXTS[1]), TEXTS[0]),
                                                   (codec.encode(TEXTS[2])[:-4], TEXTS[2]), ([], TEXTS[1])])


def _inputs(codes: list[int], text: str, binary: bool) -> list:
    ins = [http.InferInput("TOKENS", [1, len(codes)], "INT32"), http.InferInput("TOKEN_LENS", [1, 1], "INT32"),
           http.InferInput("GT_TEXT", [1, 1], "BYTES")]
    ins[0].set_data_from_numpy(np.array(codes, dtype=np.int32).reshape(1, -1), binary_data=binary)
    ins[1].set_data_from_numpy(np.array([[len(codes)]], dtype=np.int32), binary_data=binary)
    ins[2].set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_), binary_data=binary)
    return ins


def _read(result) -> tuple[float, float, str]:
    """(reward, error rate, transcript) as FP32 values, whichever way they came."""
    tr = result.as_numpy("TRANSCRIPTS")[0, 0]
    return (float(np.float32(result.as_numpy("REWARDS")[0, 0])), float(np.float32(result.as_numpy("ERROR_RATES")[0, 0])),
            tr.decode("utf-8") if isinstance(tr, bytes) else str(tr))


def test_tritonclient_binary_and_json_give_the_json_paths_rewards(sim_server_url):
    client = http.InferenceServerClient(sim_server_url.removeprefix("http://"))
    try:
        assert client.is_server_ready() and client.is_model_ready(DEFAULT_MODEL_NAME)
        assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
        for codes, text in _cases():
            rsp = requests.post(sim_server_url + infer_path(), json=build_payload(codes, text), timeout=30)
            assert rsp.status_code == 200 and "Inference-Header-Content-Length" not in rsp.headers
            assert rsp.headers["Content-Type"] == "application/json; charset=utf-8"
            reward, err, transcript, *_ = parse_response(rsp.json())
            want = (float(np.float32(reward)), float(np.float32(err)), transcript)  # FP32 outputs, exactly
            # the client's defaults: binary inputs, no outputs named -> binary_data_output
            got = client.infer(DEFAULT_MODEL_NAME, _inputs(codes, text, True))
            assert all("binary_data_size" in o["parameters"] for o in got.get_response()["outputs"])
            assert _read(got) == want, (text, codes[:5])
            # everything as JSON, both ways
            outs = [http.InferRequestedOutput(n, binary_data=False) for n in ("REWARDS", "ERROR_RATES", "TRANSCRIPTS")]
            got = client.infer(DEFAULT_MODEL_NAME, _inputs(codes, text, False), outputs=outs)
            assert all("data" in o for o in got.get_response()["outputs"])
            assert _read(got) == want
            # mixed: JSON inputs, one output in binary, the versioned route, a request id
            outs = [http.InferRequestedOutput("TRANSCRIPTS", binary_data=True),
                    http.InferRequestedOutput("REWARDS", binary_data=False),
                    http.InferRequestedOutput("ERROR_RATES", binary_data=True)]
            got = client.infer(DEFAULT_MODEL_NAME, _inputs(codes, text, False), outputs=outs, model_version="1",
                               request_id="r7")
            resp = got.get_response()
            by_name = {o["name"]: o for o in resp["outputs"]}
            assert resp["id"] == "r7" and resp["outputs"][0]["name"] == "REWARDS"  # REWARDS first, always
            assert "data" in by_name["REWARDS"] and "binary_data_size" in by_name["TRANSCRIPTS"]["parameters"]
            assert _read(got) == want
        # the client's compressed requests: the JSON length it sends is that of the uncompressed body
        for alg in ("gzip", "deflate"):
            got = client.infer(DEFAULT_MODEL_NAME, _inputs(codec.encode(TEXTS[0]), TEXTS[0], True),
                               request_compression_algorithm=alg, response_compression_algorithm=alg)
            assert _read(got)[0] == 1.0
    finally:
        client.close()


def test_tritonclient_sees_the_servers_errors(sim_server_url):
    client = http.InferenceServerClient(sim_server_url.removeprefix("http://"))
    try:
        with pytest.raises(http.InferenceServerException) as e:  # code 6561 is eos, not speech
            client.infer(DEFAULT_MODEL_NAME, _inputs([1, 2, SPEECH_TOKEN_SIZE], TEXTS[0], True))
        assert e.value.status() == "400" and "6560" in e.value.message()
        with pytest.raises(http.InferenceServerException) as e:
            client.infer("nope", _inputs([1, 2], TEXTS[0], True))
        assert e.value.status() == "404"
    finally:
        client.close()


def test_tritonclient_reads_model_config_statistics_and_repository_index():
    """Triton's management calls: tritonclient's get_model_config,
    get_inference_statistics (all models, one model, one version) and the repository index
    answer in Triton's schemas, and the statistics count what happened: every item, every batch,
    the failures, the queue and compute times."""
    from helpers import start_reward_server, stop_process

    proc, url = start_reward_server("--backend", "sim", "--max-batch", "8", "--max-delay-ms", "30",
                                    "--reward", "exp_toneless", "--log-level", "WARNING")
    client = http.InferenceServerClient(url.removeprefix("http://"), concurrency=8)
    try:
        cfg = client.get_model_config(DEFAULT_MODEL_NAME)
        assert cfg == client.get_model_config(DEFAULT_MODEL_NAME, model_version="1")
        assert cfg["name"] == DEFAULT_MODEL_NAME and cfg["max_batch_size"] == 8
        assert [(t["name"], t["data_type"], t["dims"]) for t in cfg["input"]] == [
            ("TOKENS", "TYPE_INT32", ["-1"]), ("TOKEN_LENS", "TYPE_INT32", ["1"]), ("GT_TEXT", "TYPE_STRING", ["1"]),
            ("PROMPT_ID", "TYPE_STRING", ["1"]), ("FINISHED", "TYPE_INT32", ["1"])]
        assert [t["optional"] for t in cfg["input"]] == [False, False, False, True, True]  # PROMPT_ID, FINISHED
        assert [t["name"] for t in cfg["output"]] == ["REWARDS", "TRANSCRIPTS", "ERROR_RATES", "SIMS", "CER_REWARDS",
                                                      "LENGTH_REWARDS", "MOS_OVRLS"]
        assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == "30000"
        assert cfg["parameters"]["reward"] == {"string_value": "exp_toneless"}
        assert cfg["parameters"]["backend"]["string_value"].startswith("sim")
        assert cfg["instance_group"][0]["kind"] == "KIND_CPU"
        assert client.get_model_repository_index() == [{"name": DEFAULT_MODEL_NAME, "version": "1", "state": "READY"}]
        with pytest.raises(http.InferenceServerException) as e:
            client.get_model_config("nope")
        assert e.value.status() == "404"

        n = 24
        # concurrent (the client's own async requests, 8 at a time): the server batches them
        pending = [client.async_infer(DEFAULT_MODEL_NAME, _inputs(codec.encode(t), t, True)) for t in TEXTS * 8]
        assert all(_read(r.get_result())[0] > 0 for r in pending)
        with pytest.raises(http.InferenceServerException):
            client.infer(DEFAULT_MODEL_NAME, _inputs([1, SPEECH_TOKEN_SIZE], TEXTS[0], True))  # a 400

        every = client.get_inference_statistics()  # GET /v2/models/stats
        assert every["model_stats"] == client.get_inference_statistics(DEFAULT_MODEL_NAME)["model_stats"]
        one = client.get_inference_statistics(DEFAULT_MODEL_NAME, "1")
        (st,) = one["model_stats"]
        assert st["name"] == DEFAULT_MODEL_NAME and st["version"] == "1" and st["last_inference"] > 0
        inf = st["inference_stats"]
        assert st["inference_count"] == inf["success"]["count"] == n  # the warm-up is not a request
        assert inf["fail"]["count"] == 1 and inf["success"]["ns"] > 0
        assert inf["queue"]["count"] == inf["compute_infer"]["count"] == n and inf["compute_input"]["count"] == n
        assert inf["compute_output"]["count"] == n  # the failed parse counts as a failure only
        batches = st["batch_stats"]
        assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == n
        assert sum(b["compute_infer"]["count"] for b in batches) == st["execution_count"] < n  # batched
        assert all(set(b) == {"batch_size", "compute_input", "compute_infer", "compute_output"} for b in batches)
        # each request is charged its batch's compute time, as Triton does
        assert inf["compute_infer"]["ns"] == sum(b["batch_size"] * b["compute_infer"]["ns"] for b in batches)
        assert one["ok"] == n and one["items"] == n  # ttsrl's own counters, beside Triton's
    finally:
        client.close()
        stop_process(proc)
