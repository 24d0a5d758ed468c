"""The reward server under hostile clients: the real CLI on a loopback
port, raw sockets for what an HTTP library will not send."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from helpers import stop_process

from ttsrl.embedded import codec
from ttsrl.reward.protocol import build_payload, infer_path

ROOT = Path(__file__).resolve().parents[1]
TEXT = "我想喝一杯热茶。"


def start(tmp_path: Path, *args: str, nofile: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    """The server CLI with its log in a file (to count what it writes)."""
    log = tmp_path / "server.log"

    def limit():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    f = open(log, "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "token2wav_asr_server.py"), "--backend", "sim",
                             "--port", "0", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=limit)
    deadline = time.time() + 120
    while time.time() < deadline:
        text = log.read_text()
        if "ready on http://" in text:
            return proc, text.split("ready on ")[1].split()[0], log
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    pytest.fail("server did not start:\n" + log.read_text())


def infer(url: str, body: bytes | dict, timeout: float = 30) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(url + infer_path(), data=data, headers={"Content-Type": "application/json"},
                         timeout=timeout)


def stats(url: str) -> dict:
    return requests.get(f"{url}/v2/models/token2wav_asr/stats", timeout=10).json()


def good() -> dict:
    return build_payload(codec.encode(TEXT), TEXT)


def hostile_bodies() -> dict[str, bytes]:
    g = json.dumps(good())
    codes = json.dumps([codec.encode(TEXT)])
    n = len(codec.encode(TEXT))
    out = {
        "100k-deep nesting": b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "100k-deep nesting in data": g.replace(codes, "[" * 100_000 + "1" + "]" * 100_000).encode(),
        "5000-digit integer in TOKENS": g.replace(codes, "[[" + "9" * 5000 + "]]").encode(),
        "ragged TOKENS [[1,[2],3]]": json.dumps({"inputs": [
            {"name": "TOKENS", "shape": [1, 3], "datatype": "INT32", "data": [[1, [2], 3]]},
            {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[3]]},
            {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [TEXT]}]}).encode(),
        "GT_TEXT [[[\"你好\"]]]": g.replace(json.dumps([TEXT]), json.dumps([[["你好"]]])).encode(),
        "TOKEN_LENS shape [1,2]": g.replace('"shape": [1, 1], "datatype": "INT32", "data": [[%d]]' % n,
                                            '"shape": [1, 2], "datatype": "INT32", "data": [[%d, %d]]' % (n, n)
                                            ).encode(),
    }
    for desc, body in out.items():
        assert body != g.encode(), desc  # the replacement happened
    return out


def test_hostile_bodies_get_400_not_500_and_no_traceback(tmp_path):
    proc, url, log = start(tmp_path, "--log-level", "WARNING")
    try:
        for desc, body in hostile_bodies().items():
            r = infer(url, body)
            assert r.status_code == 400, (desc, r.status_code, r.text[:300])
            assert r.json()["error"], desc
        r = infer(url, good())
        assert r.status_code == 200 and r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
        s = stats(url)
        assert s["server_errors"] == 0 and s["client_errors"] == len(hostile_bodies())
    finally:
        stop_process(proc)
    assert "Traceback" not in log.read_text()


def test_500s_are_counted_and_a_repeated_error_is_logged_once(tmp_path):
    """A backend that fails on every batch (a code the sim ASR decodes into a text the
    reward cannot take would be contrived; instead: a reward variant that needs ASR
    scores the sim ASR cannot give is refused at start, so use the real failure path: a
    BackgroundServer with a pipeline that raises)."""
    import logging

    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
    from ttsrl.reward.server import BackgroundServer, ServerConfig

    class Broken(SimToken2Wav):
        calls = 0

        def synthesize(self, batch, prompts):
            Broken.calls += 1
            if Broken.calls > 1:  # the warm-up batch passes
                raise RuntimeError("vocoder exploded")
            return super().synthesize(batch, prompts)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ttsrl.reward.server").addHandler(handler)
    try:
        with BackgroundServer(ServerConfig(port=0, max_batch=1, max_delay_ms=0),
                              pipelines=[SpeechPipeline(Broken(), SimASR())]) as srv:
            n = 20
            codes = [infer(srv.url, good()).status_code for _ in range(n)]
            assert codes == [500] * n
            s = stats(srv.url)
            assert s["server_errors"] == n and s["backend_errors"] == n
    finally:
        logging.getLogger("ttsrl.reward.server").removeHandler(handler)
    with_trace = [r for r in records if r.exc_info]
    # one traceback for the backend failure, one for the 500 it caused; the rest counted
    assert len(with_trace) == 2, [r.getMessage() for r in with_trace]
    summaries = [r.getMessage() for r in records if "repeated" in r.getMessage()]
    assert any(f"repeated {n - 1} more times" in m for m in summaries), summaries


def _partial(addr: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(addr, timeout=10)
    s.sendall(b"POST /v2/models/token2wav_asr/infer HTTP/1.1\r\nHost: x\r\n")  # headers never end
    return s


@pytest.mark.slow
def test_idle_partial_connections_do_not_block_valid_requests(tmp_path):
    """1,100 idle partial requests against a server limited to 1,024 file descriptors:
    valid requests still get answers, and the log stays small."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1300:
        pytest.skip("this test needs 1,300 file descriptors of its own")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    proc, url, log = start(tmp_path, "--log-level", "WARNING", nofile=1024)
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(1100):
            socks.append(_partial((host, int(port))))
        t0 = time.time()
        for _ in range(20):
            r = infer(url, good(), timeout=10)
            assert r.status_code == 200
        assert time.time() - t0 < 10
        s = stats(url)
        assert s["open_connections"] <= s["max_connections"] <= 512
        assert s["connections_evicted"] >= 1100 - s["max_connections"]
    finally:
        for so in socks:
            so.close()
        stop_process(proc)
    assert log.stat().st_size < 20_000, log.read_text()[:2000]


@pytest.mark.slow  # waits out the server's read timeouts: ~6 s
def test_header_and_body_read_timeouts(tmp_path):
    proc, url, log = start(tmp_path, "--log-level", "WARNING", "--idle-timeout-s", "0.5", "--body-timeout-s", "1")
    host, port = url.removeprefix("http://").split(":")
    try:
        s = _partial((host, int(port)))  # headers never complete: closed by the server
        t0 = time.time()
        assert s.recv(1024) == b""
        assert time.time() - t0 < 5
        s.close()
        body = json.dumps(good()).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v2/models/token2wav_asr/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])  # the body never completes
        t0 = time.time()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.9 < time.time() - t0 < 5
        s.close()
        assert infer(url, good()).status_code == 200
    finally:
        stop_process(proc)


def _slow_body(addr: tuple[str, int]) -> socket.socket:
    """A request declaring a 100 kB body and sending 4 bytes of it (then nothing)."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(b"POST /v2/models/token2wav_asr/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\n\r\n{\"in")
    return s


def test_slow_bodies_cannot_lock_valid_requests_out(tmp_path):
    """Connections trickling a declared body used to fill the server for the whole
    body timeout (every valid request refused). Now a new connection evicts the slowest body
    reader: with every slot held by a slow body, valid requests are answered at once, the evicted
    readers are counted (not as server errors), and nothing is logged as an ERROR."""
    proc, url, log = start(tmp_path, "--log-level", "WARNING", "--max-connections", "32", "--body-timeout-s", "60")
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        socks = [_slow_body((host, int(port))) for _ in range(32)]
        time.sleep(0.6)  # they have been reading for longer than MIN_READ_S
        assert stats(url)["connections_evicted_slow_body"] >= 1  # the /stats request itself needed a slot
        t0 = time.time()
        answered = sum(infer(url, good(), timeout=10).status_code == 200 for _ in range(20))
        assert answered == 20 and time.time() - t0 < 10
        s = stats(url)
        assert s["connections_refused"] == 0 and s["server_errors"] == 0, s
        assert s["connections_evicted_slow_body"] >= 1 and s["client_gone"] >= 1, s  # each reply frees its slot
    finally:
        for so in socks:
            so.close()
        stop_process(proc)
    assert " ERROR " not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[:2000]


# ---------------------------------------------------------------------------
# Triton's binary tensor data extension: malformed bodies


def binary_request(codes: list[int], text: str, *, tokens_size: int | None = None, text_size: int | None = None,
                   tail: bytes = b"", text_raw: bytes | None = None) -> tuple[dict, bytes]:
    """(JSON header, binary part) as ``tritonclient.http`` builds them; the sizes and
    the BYTES element can be overridden to lie."""
    import struct

    tok = struct.pack(f"<{len(codes)}i", *codes)
    lens = struct.pack("<i", len(codes))
    raw = text.encode() if text_raw is None else text_raw
    gt = struct.pack("<I", len(raw)) + raw if text_raw is None else raw
    header = {"inputs": [
        {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32",
         "parameters": {"binary_data_size": len(tok) if tokens_size is None else tokens_size}},
        {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "parameters": {"binary_data_size": 4}},
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES",
         "parameters": {"binary_data_size": len(gt) if text_size is None else text_size}}],
        "parameters": {"binary_data_output": True}}
    return header, tok + lens + gt + tail


def post_binary(url: str, header: dict | bytes, binary: bytes, length: str | None = "auto",
                timeout: float = 30) -> requests.Response:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    headers = {"Content-Type": "application/octet-stream"}
    if length is not None:
        headers["Inference-Header-Content-Length"] = str(len(head)) if length == "auto" else length
    return requests.post(url + infer_path(), data=head + binary, headers=headers, timeout=timeout)


def hostile_binary() -> dict[str, tuple[dict | bytes, bytes, str | None]]:
    """description -> (header, binary part, Inference-Header-Content-Length or "auto"/None)."""
    codes = codec.encode(TEXT)
    h, b = binary_request(codes, TEXT)
    head = json.dumps(h).encode()

    def lie(**kw):
        return binary_request(codes, TEXT, **kw)

    def with_params(name: str, **params):
        h2 = json.loads(json.dumps(h))
        next(i for i in h2["inputs"] if i["name"] == name)["parameters"].update(params)
        return h2

    out: dict[str, tuple[dict | bytes, bytes, str | None]] = {
        "header length beyond the body": (h, b, str(len(head) + len(b) + 1)),
        "header length 2**62": (h, b, str(2 ** 62)),
        "header length of 25 digits": (h, b, "9" * 25),
        "header length negative": (h, b, "-5"),
        "header length not a number": (h, b, "12abc"),
        "header length 0": (h, b, "0"),
        "header length cuts the JSON": (h, b, str(len(head) - 3)),
        "binary data but no header": (h, b, None),
        "binary_data_size but no binary part": (h, b"", "auto"),
        "sizes add up to less than the binary part": (*lie(tail=b"\0" * 7), "auto"),
        "TOKENS size runs past the end": (*lie(tokens_size=len(codes) * 4 + 400), "auto"),
        "GT_TEXT size runs past the end": (*lie(text_size=10_000), "auto"),
        "TOKENS size negative": (*lie(tokens_size=-4), "auto"),
        "TOKENS size 2**62": (*lie(tokens_size=2 ** 62), "auto"),
        "TOKENS size a string": (with_params("TOKENS", binary_data_size="8"), b, "auto"),
        "TOKENS size true": (with_params("TOKENS", binary_data_size=True), b, "auto"),
        "TOKENS size not a multiple of 4": (*lie(tokens_size=len(codes) * 4 - 2), "auto"),
        "BYTES element length beyond its buffer": (*lie(text_raw=b"\xe8\x03\0\0" + TEXT.encode()), "auto"),
        "BYTES element length 2**32-1": (*lie(text_raw=b"\xff\xff\xff\xff" + TEXT.encode()), "auto"),
        "BYTES length prefix truncated": (*lie(text_raw=b"\x05\0"), "auto"),
        "BYTES element not UTF-8": (*lie(text_raw=b"\x03\0\0\0\xff\xfe\xfd"), "auto"),
        "BYTES two elements for shape [1,1]": (*lie(text_raw=b"\x01\0\0\0a\x01\0\0\0b"), "auto"),
        "TOKENS binary and data": (with_params("TOKENS") | {"inputs": [
            dict(h["inputs"][0], data=[codes]), *h["inputs"][1:]]}, b, "auto"),
        "TOKENS binary as FP32": (with_params("TOKENS") | {"inputs": [
            dict(h["inputs"][0], datatype="FP32"), *h["inputs"][1:]]}, b, "auto"),
        "TOKENS shape larger than its bytes": (with_params("TOKENS") | {"inputs": [
            dict(h["inputs"][0], shape=[1, len(codes) + 1]), *h["inputs"][1:]]}, b, "auto"),
        "TOKENS shared memory": (with_params("TOKENS", shared_memory_region="r"), b, "auto"),
        "parameters not an object": (with_params("TOKEN_LENS") | {"parameters": [1]}, b, "auto"),
        "binary_data_output not a bool": (h | {"parameters": {"binary_data_output": "yes"}}, b, "auto"),
        "code 6561 in binary TOKENS": (*binary_request(codes[:-1] + [6561], TEXT), "auto"),
    }
    return out


def test_malformed_binary_bodies_get_400_not_500_and_no_hang(tmp_path):
    proc, url, log = start(tmp_path, "--log-level", "WARNING", "--max-tokens", "512")
    try:
        h, b = binary_request(codec.encode(TEXT), TEXT)
        r = post_binary(url, h, b)
        assert r.status_code == 200, r.text
        n = int(r.headers["Inference-Header-Content-Length"])
        assert json.loads(r.content[:n])["outputs"][0]["parameters"]["binary_data_size"] == 4
        cases = hostile_binary()
        for desc, (header, binary, length) in cases.items():
            t0 = time.time()
            r = post_binary(url, header, binary, length, timeout=10)
            assert r.status_code == 400, (desc, r.status_code, r.text[:300])
            assert r.json()["error"] and time.time() - t0 < 5, desc
        r = post_binary(url, *cases["binary data but no header"][:2], None)
        assert "needs the Inference-Header-Content-Length header" in r.json()["error"]
        r = post_binary(url, *cases["BYTES element length beyond its buffer"][:2])
        assert "claims 1000 bytes" in r.json()["error"]
        # the JSON path's limits hold for binary data too
        h, b = binary_request(list(range(513)), TEXT)
        r = post_binary(url, h, b)
        assert r.status_code == 413 and "exceed the limit of 512" in r.json()["error"], r.text
        h, b = binary_request(codec.encode(TEXT), "字" * 2001)
        assert post_binary(url, h, b).status_code == 413
        h, b = binary_request(codec.encode(TEXT), TEXT, tail=b"\0" * (1 << 20))
        assert post_binary(url, h, b).status_code == 413
        r = infer(url, good())
        assert r.status_code == 200 and r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
        s = stats(url)
        assert s["server_errors"] == 0 and s["client_errors"] == len(cases) + 5
    finally:
        stop_process(proc)
    assert "Traceback" not in log.read_text()
