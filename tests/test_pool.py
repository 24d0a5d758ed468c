"""The reward endpoint pool: several real ``sim`` reward servers on loopback
(the CLI, as run.sh starts them), a dead port, a server killed mid-run and restarted on its
port, a server that answers 503 + Retry-After, and every server gone."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from helpers import dead_url, start_reward_server, stop_process

from ttsrl.embedded import codec
from ttsrl.model.vocab import SpeechVocab
from ttsrl.reward import health
from ttsrl.reward.client import RequestFailed, RewardClientConfig, RewardServiceError, compute_score, request_reward
from ttsrl.reward.protocol import READY_PATH

TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。"]
SERVER_ARGS = ("--backend", "sim", "--log-level", "WARNING", "--max-delay-ms", "5")



def served(url: str) -> int:
    """Infer requests the server at ``url`` received (its own counter)."""
    return requests.get(f"{url}/v2/models/token2wav_asr/stats", timeout=10).json()["requests"]


def config(urls: list[str], **kw) -> RewardClientConfig:
    base = dict(url=",".join(urls), retries=3, backoff_s=0.05, max_backoff_s=0.3, timeout_s=30.0,
                max_fail_fraction=0.0, fail_window=400)
    base.update(kw)
    return RewardClientConfig(**base)


def rows(n: int) -> list[tuple[str, str]]:
    return [(SpeechVocab.codes_to_text(codec.encode(TEXTS[i % 4])), TEXTS[i % 4]) for i in range(n)]


async def score(items, cfg, after=None):
    """Score ``items`` concurrently; ``after(k)`` runs once ``k`` of them are done."""
    done = [0]

    async def one(item):
        r = await compute_score("tts", item[0], item[1], config=cfg)
        done[0] += 1
        if after:
            after(done[0])
        return r

    return await asyncio.gather(*(one(it) for it in items), return_exceptions=True)


@pytest.fixture
def two_servers():
    with ThreadPoolExecutor(2) as pool:  # start both at once
        procs = list(pool.map(lambda _: start_reward_server(*SERVER_ARGS), range(2)))
    yield procs
    for p, _ in procs:
        if p.poll() is None:
            stop_process(p)


@pytest.mark.slow  # three server processes: ~12 s
def test_pool_fails_over_then_readmits_a_restarted_server(two_servers, caplog):
    (proc_a, url_a), (_, url_b) = two_servers
    dead = dead_url()
    cfg = config([url_a, url_b, dead])
    assert health.main([f"{url_a},{url_b}", "--wait", "5"]) == 0
    assert health.main([url_a, url_b, dead, "--at-least", "2"]) == 0
    assert health.main([url_a, url_b, dead]) == 1  # all of them: the dead port is missing

    # 400 rows; the server at url_a is SIGKILLed with requests in flight, once 50 are scored and
    # it has answered one (on a loaded machine b may answer the first 50 alone: CI saw a's first
    # reply come after them), or at the 300th whatever a did (then the check below says so)
    seen_by_a = []

    def kill_a(k):
        if not seen_by_a and k >= 50 and (cfg.pool.counts()[url_a]["ok"] >= 1 or k >= 300):
            seen_by_a.append(served(url_a))
            proc_a.send_signal(signal.SIGKILL)

    t0 = time.perf_counter()
    out = asyncio.run(score(rows(400), cfg, after=kill_a))
    seconds = time.perf_counter() - t0
    assert not [r for r in out if isinstance(r, BaseException)], out
    assert [r["reward_failed"] for r in out] == [0.0] * 400  # no reward failed
    assert all(r["score"] == pytest.approx(1.0) for r in out)
    counts = cfg.pool.counts()
    a, b, d = counts[url_a], counts[url_b], counts[dead]
    print(f"\n400 rows in {seconds:.2f} s; client counts {counts}; server a saw {seen_by_a[0]} before the kill, "
          f"server b {served(url_b)}")
    # both servers did work and the counts add up: every row answered once, by a or b
    assert a["ok"] >= 1 and b["ok"] >= 1 and d["ok"] == 0 and a["ok"] + b["ok"] == 400
    assert served(url_b) == b["sent"] == b["ok"]  # b answered every request the client sent it
    # a's counter is read just before the kill and a answers on until the signal lands (64 answers
    # against 32 counted, on a fast machine), so only the bound by what was sent holds
    assert 1 <= seen_by_a[0] <= a["sent"]
    assert all(c["sent"] == c["ok"] + c["failed"] for c in counts.values())  # no refusals
    assert d["failed"] >= 1 and a["up"] == 0 and d["up"] == 0 and b["up"] == 1
    # each failover is logged once, however many requests were in flight there
    outs = [r.getMessage() for r in caplog.records if "out of rotation" in r.getMessage()]
    assert [sum(f"server {u} out" in m for m in outs) for u in (url_a, url_b, dead)] == [1, 0, 1], outs

    # url_a restarted on the same port: probed ready, back in rotation, receives requests again
    port_a = url_a.rsplit(":", 1)[1]
    proc_a2, url_a2 = start_reward_server(*SERVER_ARGS, "--port", port_a)
    try:
        assert url_a2 == url_a
        time.sleep(0.5)  # past the longest backoff (max_backoff_s 0.3)
        out = asyncio.run(score(rows(40), cfg))
        assert [r["reward_failed"] for r in out] == [0.0] * 40
        assert served(url_a) >= 1 and cfg.pool.counts()[url_a]["up"] == 1
        assert cfg.pool.counts()[url_a]["ok"] - a["ok"] == served(url_a)

        # every server gone: the request fails with an error naming each URL and its last error
        stop_process(proc_a2)
        two_servers[1][0].send_signal(signal.SIGKILL)
        two_servers[1][0].wait()
        codes = codec.encode(TEXTS[0])
        with pytest.raises(RequestFailed) as ei:
            asyncio.run(request_reward(codes, TEXTS[0], cfg))
        msg = str(ei.value)
        assert not ei.value.refused and all(f"{u}: " in msg for u in (url_a, url_b, dead)), msg
        with pytest.raises(RewardServiceError) as ei:  # max_fail_fraction 0: the first failure is too many
            asyncio.run(compute_score("tts", rows(1)[0][0], TEXTS[0], config=cfg))
        assert all(u in str(ei.value) for u in (url_a, url_b, dead)), str(ei.value)
    finally:
        if proc_a2.poll() is None:
            stop_process(proc_a2)


class Canned(BaseHTTPRequestHandler):
    """A stand-in server that answers ready, counts infer requests and answers each with
    :meth:`answer` (status, JSON body, headers)."""

    posts = 0

    def do_GET(self):
        self._send(200 if self.path == READY_PATH else 404, b"{}", {})

    def do_POST(self):
        type(self).posts += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(*self.answer())

    def answer(self) -> tuple[int, bytes, dict]:
        raise NotImplementedError

    def _send(self, status, body, headers):
        self.send_response(status)
        for k, v in {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Busy(Canned):
    """Ready, but every infer request gets 503 with Retry-After (a full queue)."""

    retry_after = "30"

    def answer(self):
        return 503, b'{"error": "queue full"}', {"Retry-After": self.retry_after}


@contextlib.contextmanager
def serving(handler: type[Canned]):
    """``handler`` on a free loopback port, its post count reset; yields its URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    handler.posts = 0
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def busy_server():
    with serving(Busy) as url:
        yield url


def test_503_with_retry_after_redirects_instead_of_sleeping(busy_server, sim_server_url):
    cfg = config([busy_server, sim_server_url])
    t0 = time.perf_counter()
    out = asyncio.run(score(rows(20), cfg))
    seconds = time.perf_counter() - t0
    assert [r["reward_failed"] for r in out] == [0.0] * 20
    counts = cfg.pool.counts()
    busy = counts[busy_server]
    # the busy server was asked (requests in flight at its first answer), then skipped: nobody
    # waited its 30 s Retry-After, and it stays in rotation (busy, not broken)
    assert Busy.posts == busy["sent"] == busy["failed"] >= 1 and busy["up"] == 1
    assert counts[sim_server_url]["ok"] == 20 and seconds < 10, (seconds, counts)


def test_503_everywhere_sleeps_for_retry_after_then_fails_naming_the_server(busy_server):
    Busy.retry_after = "0.2"
    try:
        cfg = config([busy_server], retries=2)
        t0 = time.perf_counter()
        with pytest.raises(RequestFailed) as ei:
            asyncio.run(request_reward(codec.encode(TEXTS[1]), TEXTS[1], cfg))
        seconds = time.perf_counter() - t0
    finally:
        Busy.retry_after = "30"
    assert f"{busy_server}: HTTP 503" in str(ei.value) and not ei.value.refused
    assert Busy.posts == 3 and 0.35 < seconds < 5  # two waits of Retry-After, then the third answer gave up


def test_health_cli_names_the_servers_not_ready(sim_server_url):
    dead = dead_url()
    res = subprocess.run([sys.executable, "-m", "ttsrl.reward.health", f"{sim_server_url},{dead}"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and f"not ready: {dead}" in res.stderr and "1 of 2" in res.stderr
    res = subprocess.run([sys.executable, "-m", "ttsrl.reward.health", sim_server_url, dead,
                          "--at-least", "1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


class Lying(Canned):
    """Ready, and every infer request answered 200 with ``body`` (a readable JSON answer that no
    honest reward server gives)."""

    body: object = {}

    def answer(self):
        return 200, __import__("json").dumps(type(self).body).encode(), {}


@pytest.fixture
def lying_server():
    with serving(Lying) as url:
        yield url


def answer(reward=0.5, error_rate=0.1, model="token2wav_asr", **extra) -> dict:
    return {"model_name": model, "model_version": "1", "outputs": [
        {"name": "REWARDS", "datatype": "FP32", "shape": [1, 1], "data": [reward]},
        {"name": "TRANSCRIPTS", "datatype": "BYTES", "shape": [1, 1], "data": ["ni3 hao3"]},
        {"name": "ERROR_RATES", "datatype": "FP32", "shape": [1, 1], "data": [error_rate]}], **extra}


IMPOSSIBLE = {"reward -5": answer(-5.0), "reward 1e6": answer(1e6), "reward true": answer(True),
              "reward as a string": answer("0.75"), "error rate NaN": answer(error_rate=float("nan")),
              "error rate -3": answer(error_rate=-3.0), "another model": answer(model="other_model"),
              "beyond its own range": answer(1.2, parameters={"reward_range": [0.0, 1.0]}),
              "an empty object": {}, "no REWARDS": {"model_name": "token2wav_asr", "outputs": []}}


@pytest.mark.parametrize("why", sorted(IMPOSSIBLE))
def test_an_impossible_answer_is_a_failure_never_a_reward(lying_server, why):
    """Such answers used to give '0 failed' and their numbers reached verl."""
    Lying.body = IMPOSSIBLE[why]
    with pytest.raises(RequestFailed, match="invalid answer"):
        asyncio.run(request_reward(codec.encode(TEXTS[0]), TEXTS[0], config([lying_server], retries=1)))
    out = asyncio.run(compute_score("tts", *rows(1)[0], config=config([lying_server], retries=1,
                                                                      max_fail_fraction=1.0)))
    assert out["reward_failed"] == 1.0 and out["score"] == 0.0, out


def test_a_possible_answer_from_such_a_server_is_accepted(lying_server):
    """The checks let an honest answer through: a SIM-weighted reward above 1 inside the range the
    server advertises, an error rate above 1."""
    Lying.body = answer(1.05, error_rate=1.5, parameters={"reward_range": [-0.1, 1.1]})
    got = asyncio.run(request_reward(codec.encode(TEXTS[0]), TEXTS[0], config([lying_server])))
    assert (got.reward, got.error_rate, got.transcript) == (1.05, 1.5, "ni3 hao3")


def test_a_server_answering_invalid_200s_leaves_the_rotation(lying_server, sim_server_url, caplog):
    """One server answering `{}` beside a good one: every row is scored by the
    good one (40 rows -> 0 failed; it was 20 failed), every answer of the liar counts as its
    failure and takes it out of rotation (until its backoff has passed and it answers ready)."""
    Lying.body = {}
    cfg = config([lying_server, sim_server_url], max_fail_fraction=1.0)
    out = asyncio.run(score(rows(40), cfg))
    assert [r["reward_failed"] for r in out] == [0.0] * 40, out
    counts = cfg.pool.counts()
    assert counts[lying_server]["ok"] == 0 and counts[lying_server]["failed"] == Lying.posts >= 1
    assert counts[sim_server_url]["ok"] == 40, counts
    assert f"reward server {lying_server} out of rotation" in caplog.text and "invalid answer" in caplog.text
