"""NVIDIA's own ``tritonclient.http`` against the reward server CLI on a loopback port
(issue 19 A): binary tensor data on (the client's default) and off give the same
rewards, transcripts and error rates as the plain JSON path."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.http as http

from ttsrl.embedded import codec
from ttsrl.model.vocab import SPEECH_TOKEN_SIZE
from ttsrl.reward.protocol import DEFAULT_MODEL_NAME, build_payload, infer_path, parse_response

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
            reward, err, transcript, _ = parse_response(rsp.json())
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
