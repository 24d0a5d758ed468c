"""``GET /metrics`` of the reward server: the real CLI on a loopback port,
real traffic, a Prometheus text scrape whose counts equal what was sent."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from helpers import start_reward_server, stop_process
from prometheus_client.parser import text_string_to_metric_families

from ttsrl.embedded import codec
from ttsrl.reward.backends import SpeechPipeline
from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
from ttsrl.reward.protocol import build_payload, infer_path
from ttsrl.reward.server import BackgroundServer, ServerConfig

TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。"]
MODEL = "token2wav_asr"


def scrape(url: str, accept: str | None = None) -> tuple[dict[tuple[str, tuple], float], str]:
    """{(sample name, sorted labels): value} of one scrape, and its content type."""
    r = requests.get(url + "/metrics", headers={"Accept": accept} if accept else {}, timeout=10)
    assert r.status_code == 200, r.text
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, r.headers["Content-Type"]


@pytest.mark.slow  # a server CLI under load: ~9 s
def test_metrics_count_exactly_what_was_sent():
    proc, url = start_reward_server("--backend", "sim", "--max-batch", "8", "--max-delay-ms", "30",
                                    "--max-tokens", "500", "--log-level", "WARNING")
    try:
        before, ctype = scrape(url)
        assert ctype.startswith("text/plain; version=0.0.4")
        assert before[("ttsrl_infer_requests_total", ())] == 0  # the warm-up batch is not counted
        assert before[("ttsrl_batch_size_count", ())] == 0
        n_ok = 40
        barrier = threading.Barrier(n_ok)
        # built here: codec.encode's first calls in 40 threads at once take half a minute on 2 cores
        payloads = [build_payload(codec.encode(TEXTS[i % len(TEXTS)]), TEXTS[i % len(TEXTS)]) for i in range(n_ok)]

        def one(i):
            barrier.wait()
            return requests.post(url + infer_path(), json=payloads[i], timeout=60)

        with ThreadPoolExecutor(n_ok) as pool:
            assert all(r.status_code == 200 for r in pool.map(one, range(n_ok)))
        bad = {400: [b"not json", b"{}", json.dumps(build_payload([1, 6561], TEXTS[0])).encode()],
               413: [json.dumps(build_payload([1] * 501, TEXTS[0])).encode()]}
        for status, bodies in bad.items():
            for body in bodies:
                assert requests.post(url + infer_path(), data=body, timeout=30).status_code == status
        wrong_model = 2
        for _ in range(wrong_model):
            assert requests.post(url + infer_path("nope"), json=build_payload([1, 2], TEXTS[0]),
                                 timeout=30).status_code == 404
        requests.get(url + "/v2/health/ready", timeout=5)  # not an infer request: not counted
        assert requests.get(f"{url}/v2/models/nope", timeout=5).status_code == 404  # nor is this 404

        m, _ = scrape(url)
        stats = requests.get(f"{url}/v2/models/{MODEL}/stats", timeout=5).json()
        sent = n_ok + sum(len(b) for b in bad.values()) + wrong_model
        assert m[("ttsrl_infer_requests_total", ())] == sent
        assert m[("ttsrl_infer_request_seconds_count", ())] == sent
        failures = {dict(k[1])["status"]: v for k, v in m.items() if k[0] == "ttsrl_infer_failures_total"}
        assert failures == {"400": 3, "413": 1, "404": wrong_model}
        # /stats counts the same requests, each once by its answer (not only the
        # handled infer requests in `requests` while every 4xx counts in `client_errors`)
        assert stats["requests"] == sent and stats["ok"] == n_ok
        assert stats["client_errors"] == 3 + 1 + wrong_model and stats["server_errors"] == 0
        assert stats["requests"] == sum(stats[k] for k in ("ok", "client_errors", "unavailable", "server_errors",
                                                         "client_gone"))
        # batches: the histogram agrees with the server's own counters, and holds every scored item
        assert m[("ttsrl_batch_size_count", ())] == stats["batches"] > 0
        assert m[("ttsrl_batch_size_sum", ())] == stats["items"] == n_ok
        cum = 0
        for size in (1, 2, 4, 8):
            cum += sum(v for k, v in stats["batch_size_histogram"].items() if size // 2 < int(k) <= size)
            assert m[("ttsrl_batch_size_bucket", (("le", f"{size}.0"),))] == cum
        for stage in ("token2wav", "asr", "scoring"):
            assert m[("ttsrl_stage_seconds_count", (("stage", stage),))] == stats["batches"]
            assert m[("ttsrl_stage_seconds_sum", (("stage", stage),))] >= 0
        assert m[("ttsrl_queue_depth", ())] == 0
        assert m[("ttsrl_open_connections", ())] >= 1  # this scrape's own
        # OpenMetrics for a scraper that asks for it
        r = requests.get(url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                         timeout=5)
        assert r.headers["Content-Type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")
    finally:
        stop_process(proc)


class SlowSim(SimToken2Wav):
    def synthesize(self, batch, prompts):
        time.sleep(0.3)
        return super().synthesize(batch, prompts)


def test_queue_depth_and_stage_time_are_live():
    cfg = ServerConfig(port=0, max_batch=1, max_delay_ms=0)
    with BackgroundServer(cfg, pipelines=[SpeechPipeline(SlowSim(), SimASR())]) as srv:
        n = 5
        payload = build_payload(codec.encode(TEXTS[0]), TEXTS[0])
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(requests.post, srv.url + infer_path(), json=payload, timeout=60) for _ in range(n)]
            time.sleep(0.45)  # one batch in the backend, the rest waiting
            m, _ = scrape(srv.url)
            assert 1 <= m[("ttsrl_queue_depth", ())] <= n - 1
            assert all(f.result().status_code == 200 for f in futures)
        m, _ = scrape(srv.url)
        assert m[("ttsrl_queue_depth", ())] == 0
        assert m[("ttsrl_stage_seconds_count", (("stage", "token2wav"),))] == n
        assert m[("ttsrl_stage_seconds_sum", (("stage", "token2wav"),))] >= 0.3 * n
        assert m[("ttsrl_stage_seconds_sum", (("stage", "asr"),))] < 0.3
