"""Prometheus metrics of the reward server: ``GET /metrics`` (text exposition format,
or OpenMetrics when the scraper asks for it), built with ``prometheus_client``.

    ttsrl_infer_requests_total                 infer requests received (any outcome)
    ttsrl_infer_failures_total{status}         infer requests not answered 200, by HTTP status
    ttsrl_infer_request_seconds                one infer request, arrival to answer
    ttsrl_queue_depth                          requests waiting for a backend worker
    ttsrl_open_connections                     open HTTP connections
    ttsrl_batch_size                           items per backend batch (a successful one)
    ttsrl_batches_split_total                  batches that raised and were scored item by item
    ttsrl_stage_seconds{stage}                 per batch: token2wav, asr, scoring
                                               (scoring: normalisation, pinyin, error rate, reward)

Each server owns its registry (two servers in one process do not mix counts). The
warm-up batch at start-up is not counted.
"""

from __future__ import annotations

import time
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

STAGES = ("token2wav", "asr", "scoring")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _size_buckets(max_batch: int) -> list[float]:
    out, b = [], 1
    while b < max_batch:
        out.append(float(b))
        b *= 2
    return out + [float(max_batch)]


def is_infer(request: web.Request) -> bool:
    return request.method == "POST" and request.path.endswith("/infer")


class ServerMetrics:
    def __init__(self, max_batch: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ttsrl_infer_requests", "Infer requests received", registry=r)
        self.failures = Counter("ttsrl_infer_failures", "Infer requests not answered 200, by HTTP status",
                                ["status"], registry=r)
        self.request_seconds = Histogram("ttsrl_infer_request_seconds", "Seconds from an infer request's "
                                         "arrival to its answer", buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("ttsrl_queue_depth", "Requests waiting for a backend worker", registry=r)
        self.open_connections = Gauge("ttsrl_open_connections", "Open HTTP connections", registry=r)
        self.batch_size = Histogram("ttsrl_batch_size", "Items per backend batch", buckets=_size_buckets(max_batch),
                                    registry=r)
        self.batches_split = Counter("ttsrl_batches_split", "Batches that raised and were scored item by item "
                                     "(only the items that fail alone get an error)", registry=r)
        self.stage_seconds = Histogram("ttsrl_stage_seconds", "Seconds per batch spent in each stage "
                                       "(token2wav, asr, scoring)", ["stage"], buckets=_SECONDS, registry=r)
        for stage in STAGES:  # present (at zero) before the first batch
            self.stage_seconds.labels(stage)

    def watch(self, queue_depth: Callable[[], int], open_connections: Callable[[], int]) -> None:
        """Read the gauges from the live server at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.open_connections.set_function(open_connections)

    def observe_batch(self, size: int, total_s: float, stage_s: dict[str, float]) -> None:
        """One scored batch: its size, and its time split into stages (``stage_s`` has
        token2wav and asr from the pipeline; scoring is the rest of ``total_s``)."""
        self.batch_size.observe(size)
        t2w, asr = stage_s.get("token2wav", 0.0), stage_s.get("asr", 0.0)
        self.stage_seconds.labels("token2wav").observe(t2w)
        self.stage_seconds.labels("asr").observe(asr)
        self.stage_seconds.labels("scoring").observe(max(0.0, total_s - t2w - asr))

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Counts and times infer requests; goes outside the server's error middleware,
        so it sees the status every request is answered with."""
        if not is_infer(request):
            return await handler(request)
        self.requests.inc()
        t0 = time.perf_counter()
        status = "500"
        try:
            resp = await handler(request)
            status = str(resp.status)
            return resp
        except web.HTTPException as e:
            status = str(e.status)
            raise
        finally:
            self.request_seconds.observe(time.perf_counter() - t0)
            if status != "200":
                self.failures.labels(status).inc()

    async def handle(self, request: web.Request) -> web.Response:
        """``GET /metrics``."""
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})
