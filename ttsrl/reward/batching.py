"""Dynamic batching for the reward server: a bounded queue and one worker per replica.

Concurrent requests are batched (up to ``max_batch`` items, waiting at most
``max_delay_ms`` after the oldest one arrived) and spread over one backend replica
per local device. The queue is bounded: when ``max_queue`` requests wait, a new one
is refused (the server answers 503 with ``Retry-After``).

One bad item never fails its neighbours: when scoring a batch raises, each of its
items is scored alone, and only an item that fails by itself gets an error (422 when
its input made scoring raise ``ValueError``, which a retry cannot change; else 500).
Such a batch is counted (``split_batches`` in /stats, ``ttsrl_batches_split_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from ttsrl.reward.backends import SpeechPipeline
from ttsrl.reward.infer_request import RequestError
from ttsrl.reward.scoring import Scored
from ttsrl.reward.triton_admin import TritonStats

log = logging.getLogger("ttsrl.reward.server")


@dataclass
class Item:
    codes: list[int]
    text: str
    future: asyncio.Future
    t_enqueued: float
    prompt_id: str | None = None  # the request's PROMPT_ID (None: the speaker is chosen from the text)


class Stats:
    def __init__(self):
        self.requests = 0
        self.ok = 0
        self.client_errors = 0
        self.client_gone = 0  # connections closed before their request body arrived (answered 499)
        self.unavailable = 0  # answered 503: not ready yet, or the queue full (rejected_full of them)
        self.rejected_full = 0
        self.backend_errors = 0
        self.server_errors = 0  # requests answered 500
        self.batches = 0
        self.split_batches = 0  # batches that raised and were scored item by item
        self.items = 0
        self.backend_seconds = 0.0
        self.batch_sizes: Counter[int] = Counter()
        self.max_queue_depth = 0
        self.triton = TritonStats()  # the same activity in Triton's statistics schema

    def answered(self, status: int) -> None:
        """One infer request, answered with ``status``."""
        self.requests += 1
        if status == 200:
            self.ok += 1
        elif status == 499:
            self.client_gone += 1
        elif status == 503:
            self.unavailable += 1
        elif status < 500:
            self.client_errors += 1
        else:
            self.server_errors += 1

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "ok": self.ok, "client_errors": self.client_errors,
            "client_gone": self.client_gone, "unavailable": self.unavailable,
            "rejected_queue_full": self.rejected_full, "backend_errors": self.backend_errors,
            "server_errors": self.server_errors,
            "batches": self.batches, "split_batches": self.split_batches, "items": self.items,
            "mean_batch_size": self.items / self.batches if self.batches else 0.0,
            "max_batch_size": max(self.batch_sizes, default=0),
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "backend_seconds": self.backend_seconds, "max_queue_depth": self.max_queue_depth,
        }


class Batcher:
    """Bounded queue + one batching worker per pipeline (device)."""

    def __init__(self, cfg, pipelines: Sequence[SpeechPipeline], stats: Stats,
                 score: Callable[[SpeechPipeline, list, list, list], list[Scored]], errors=None,
                 on_split: Callable[[], None] | None = None):
        self.cfg = cfg  # a ServerConfig: max_batch, max_delay_ms, max_queue
        self.score = score
        self.errors = errors  # a RepeatedErrors: a failure that repeats is logged once, counted
        self.on_split = on_split  # called once per batch scored item by item (the server's metric)
        self.pipelines = list(pipelines)
        self.stats = stats
        self.queue: deque[Item] = deque()
        self._arrived = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"backend-{p.device}") for p in self.pipelines]

    def start(self) -> None:
        for i in range(len(self.pipelines)):
            self._tasks.append(asyncio.get_running_loop().create_task(self._worker(i)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self._pools:
            p.shutdown(wait=False, cancel_futures=True)
        while self.queue:
            it = self.queue.popleft()
            if not it.future.done():
                it.future.set_exception(RuntimeError("server shutting down"))

    def submit(self, codes: list[int], text: str, prompt_id: str | None = None) -> asyncio.Future:
        if len(self.queue) >= self.cfg.max_queue:
            self.stats.rejected_full += 1
            raise RequestError(f"queue full ({self.cfg.max_queue} waiting); retry later", 503)
        loop = asyncio.get_running_loop()
        item = Item(codes, text, loop.create_future(), loop.time(), prompt_id)
        self.queue.append(item)
        self.stats.max_queue_depth = max(self.stats.max_queue_depth, len(self.queue))
        self._arrived.set()
        return item.future

    async def _next_batch(self) -> list[Item]:
        loop = asyncio.get_running_loop()
        while not self.queue:
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self.queue[0].t_enqueued + self.cfg.max_delay_ms / 1000.0
        while self.queue and len(self.queue) < self.cfg.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        n = min(self.cfg.max_batch, len(self.queue))
        return [self.queue.popleft() for _ in range(n)]

    async def _worker(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        pipeline, pool = self.pipelines[index], self._pools[index]
        while True:
            batch = await self._next_batch()
            if not batch:
                continue  # another worker took them
            now = loop.time()
            self.stats.triton.durations["queue"].add(sum(now - it.t_enqueued for it in batch) * 1e9, len(batch))
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(pool, self.score, pipeline, [it.codes for it in batch],
                                                     [it.text for it in batch], [it.prompt_id for it in batch])
            except Exception as e:
                self._log_failure(pipeline, e, len(batch))
                if len(batch) == 1:
                    self._fail(batch[0], e)
                    continue
                # one bad item must not fail its neighbours: score each alone, so only
                # the items that fail by themselves get an error
                self.stats.split_batches += 1
                if self.on_split is not None:
                    self.on_split()
                results = []
                for it in batch:
                    try:
                        results.append((await loop.run_in_executor(pool, self.score, pipeline,
                                                                   [it.codes], [it.text], [it.prompt_id]))[0])
                    except Exception as e1:
                        self._log_failure(pipeline, e1, 1)
                        results.append(e1)
            finally:
                took = time.perf_counter() - t0
                self.stats.backend_seconds += took
                self.stats.triton.executed(len(batch), took * 1e9)
            self.stats.batches += 1
            self.stats.items += len(batch)
            self.stats.batch_sizes[len(batch)] += 1
            for it, r in zip(batch, results):
                if isinstance(r, Exception):
                    self._fail(it, r)
                elif not it.future.done():  # the client may have gone away
                    it.future.set_result(r)

    def _log_failure(self, pipeline: SpeechPipeline, e: Exception, n: int) -> None:
        if self.errors is not None:
            self.errors.error(f"backend {pipeline.name} failed: {type(e).__name__}: {e}"[:300],
                              "backend %s failed on a batch of %d", pipeline.name, n, exc_info=e)
        else:
            log.exception("backend %s failed on a batch of %d", pipeline.name, n)

    def _fail(self, item: Item, e: Exception) -> None:
        """Answer one item that failed on its own: 422 when its input made scoring
        raise ValueError (the same input always will: clients must not retry it); any
        other exception goes to the server's 500 path (counted, logged once)."""
        self.stats.backend_errors += 1
        if not item.future.done():
            if isinstance(e, ValueError):
                e = RequestError(f"cannot score this request: {type(e).__name__}: {e}"[:400], 422)
            item.future.set_exception(e)
