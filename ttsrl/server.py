"""The reward server (stage 1): speech tokens -> audio -> ASR -> error rate -> reward.

Wire protocol: KServe v2 / Triton HTTP JSON, so a Triton client (and the request
the reference recipe's ``reward_tts.py`` builds) works unchanged::

    POST /v2/models/{name}/infer            (also .../versions/{v}/infer)
      inputs  TOKENS INT32 [1,N]   speech codes 0..6560 (nested [[...]] or flat data)
              TOKEN_LENS INT32 [1,1]  number of valid codes (<= N)
              GT_TEXT BYTES [1,1]     the text the speech should say (UTF-8)
      outputs REWARDS FP32 [1,1], TRANSCRIPTS BYTES [1,1], ERROR_RATES FP32 [1,1]
              (REWARDS first: the reference client reads outputs[0].data[0])
    GET /v2/health/live, /v2/health/ready, /v2, /v2/models/{name}, /v2/models/{name}/ready
    GET /v2/models/{name}/stats   request/batch counters and the batch-size histogram

Every bad request gets a 4xx with ``{"error": message}``; an empty token list gets
reward 0 by definition. Concurrent requests are batched dynamically (up to
``max_batch`` items, waiting at most ``max_delay_ms`` after the oldest one arrived)
and spread over one backend replica per local device. The queue is bounded: when
``max_queue`` requests wait, new ones get 503 with ``Retry-After``.

HTTP stack: aiohttp. It is maintained, already a dependency (verl's reward loop
uses it), runs the whole server on one asyncio loop with no per-request
framework validation (the KServe payload needs hand validation anyway), and lets
us cap the body size before it is read (``client_max_size``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from aiohttp import web

from ttsrl.backends import BackendConfig, SpeechPipeline, build_pipeline, local_devices
from ttsrl.vocab import SPEECH_TOKEN_SIZE

log = logging.getLogger("ttsrl.server")

INPUT_SPECS = (("TOKENS", "INT32", [1, -1]), ("TOKEN_LENS", "INT32", [1, 1]), ("GT_TEXT", "BYTES", [1, 1]))
OUTPUT_SPECS = (("REWARDS", "FP32", [1, 1]), ("TRANSCRIPTS", "BYTES", [1, 1]), ("ERROR_RATES", "FP32", [1, 1]))
MODEL_VERSION = "1"
MAX_GT_CHARS = 2000


@dataclass
class ServerConfig:
    backend: BackendConfig = field(default_factory=BackendConfig)
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (printed when ready)
    model_name: str = "token2wav_asr"
    reward: str = "tanh"  # a name in ttsrl.text.REWARDS
    length_guard: bool = True  # scale rewards of implausibly long/short speech down
    max_batch: int = 32
    max_delay_ms: float = 10.0
    max_queue: int = 4096  # requests waiting for a worker; more get 503
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # speech codes per sequence (CosyVoice2: 25/s -> 160 s)
    devices: list[str] | None = None  # None: every local device
    retry_after_s: int = 1

    def validate(self) -> None:
        from ttsrl.text import REWARDS

        if self.reward not in REWARDS:
            raise ValueError(f"unknown reward {self.reward!r}; choose from {sorted(REWARDS)}")
        for name in ("max_batch", "max_queue", "max_body_bytes", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_delay_ms < 0:
            raise ValueError("max_delay_ms must be >= 0")
        self.backend.validate()


class RequestError(Exception):
    """A client error: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------
# request parsing


@dataclass
class Item:
    codes: list[int]
    text: str
    future: asyncio.Future
    t_enqueued: float


def _flatten(data: Any, name: str) -> list:
    """KServe allows row-major flat data or nested lists; return it flat."""
    if not isinstance(data, list):
        raise RequestError(f"input {name}: 'data' must be a list, got {type(data).__name__}")
    out: list = []
    stack = [iter(data)]
    depth = 1
    while stack:
        try:
            x = next(stack[-1])
        except StopIteration:
            stack.pop()
            depth -= 1
            continue
        if isinstance(x, list):
            depth += 1
            if depth > 3:
                raise RequestError(f"input {name}: 'data' is nested too deeply")
            stack.append(iter(x))
        else:
            out.append(x)
    return out


def _shape(spec: dict, name: str) -> list[int]:
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise RequestError(f"input {name}: 'shape' must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise RequestError(f"input {name}: negative dimension in shape {shape}")
    return shape


def _ints(spec: dict, name: str, max_count: int) -> tuple[list[int], list[int]]:
    if spec.get("datatype") != "INT32":
        raise RequestError(f"input {name}: datatype must be INT32, got {spec.get('datatype')!r}")
    shape = _shape(spec, name)
    if "data" not in spec:
        raise RequestError(f"input {name}: missing 'data' (binary tensor data is not supported)")
    if len(shape) != 2 or shape[0] != 1:
        raise RequestError(f"input {name}: shape must be [1, N], got {shape}")
    if shape[1] > max_count:
        raise RequestError(f"input {name}: {shape[1]} elements exceed the limit of {max_count}", 413)
    values = _flatten(spec["data"], name)
    if len(values) != shape[1]:
        raise RequestError(f"input {name}: shape {shape} needs {shape[1]} values, data has {len(values)}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise RequestError(f"input {name}: INT32 data must be integers, got {v!r}")
        if not -(2 ** 31) <= v < 2 ** 31:
            raise RequestError(f"input {name}: {v} does not fit INT32")
    return values, shape


def _text(spec: dict) -> str:
    name = "GT_TEXT"
    if spec.get("datatype") != "BYTES":
        raise RequestError(f"input {name}: datatype must be BYTES, got {spec.get('datatype')!r}")
    shape = _shape(spec, name)
    if shape not in ([1, 1], [1]):
        raise RequestError(f"input {name}: shape must be [1, 1], got {shape}")
    if "data" not in spec:
        raise RequestError(f"input {name}: missing 'data'")
    values = _flatten(spec["data"], name)
    if len(values) != 1:
        raise RequestError(f"input {name}: expected exactly one string, got {len(values)} values")
    v = values[0]
    if isinstance(v, dict) and set(v) == {"b64"}:  # binary string sent as base64
        try:
            raw = base64.b64decode(v["b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise RequestError(f"input {name}: invalid base64") from None
        try:
            v = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"input {name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(v, str):
        raise RequestError(f"input {name}: expected a string, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"input {name}: not valid UTF-8 (lone surrogate)") from None
    if not v.strip():
        raise RequestError(f"input {name}: text is empty")
    if len(v) > MAX_GT_CHARS:
        raise RequestError(f"input {name}: text longer than {MAX_GT_CHARS} characters", 413)
    return v


def parse_infer_request(body: bytes, max_tokens: int) -> tuple[list[int], str, Any, list[str] | None]:
    """Validate a KServe v2 infer body -> (codes, text, request id, requested outputs)."""
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError("body must be a JSON object with an 'inputs' list")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("body must have a non-empty 'inputs' list")
    by_name: dict[str, dict] = {}
    for spec in inputs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError("every input must be an object with a 'name'")
        name = spec["name"]
        if name not in {n for n, _, _ in INPUT_SPECS}:
            raise RequestError(f"unknown input {name!r}; expected TOKENS, TOKEN_LENS, GT_TEXT")
        if name in by_name:
            raise RequestError(f"input {name} given twice")
        by_name[name] = spec
    missing = [n for n, _, _ in INPUT_SPECS if n not in by_name]
    if missing:
        raise RequestError(f"missing input(s) {', '.join(missing)}")

    tokens, tshape = _ints(by_name["TOKENS"], "TOKENS", max_tokens)
    lens, _ = _ints(by_name["TOKEN_LENS"], "TOKEN_LENS", 1)
    if len(lens) != 1:
        raise RequestError("input TOKEN_LENS: shape must be [1, 1]")
    n = lens[0]
    if not 0 <= n <= tshape[1]:
        raise RequestError(f"input TOKEN_LENS: {n} is not in 0..{tshape[1]} (the length of TOKENS)")
    codes = tokens[:n]
    for c in codes:
        if not 0 <= c < SPEECH_TOKEN_SIZE:
            raise RequestError(f"input TOKENS: speech code {c} outside 0..{SPEECH_TOKEN_SIZE - 1}")
    text = _text(by_name["GT_TEXT"])

    wanted = None
    if "outputs" in req:
        outs = req["outputs"]
        known = {n for n, _, _ in OUTPUT_SPECS}
        if not isinstance(outs, list) or not all(isinstance(o, dict) and o.get("name") in known for o in outs):
            raise RequestError(f"'outputs' must list objects named among {sorted(known)}")
        wanted = [o["name"] for o in outs]
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'id' must be a string")
    return codes, text, rid, wanted


# ---------------------------------------------------------------------------
# batching


@dataclass
class Result:
    reward: float
    error_rate: float
    transcript: str


class Stats:
    def __init__(self):
        self.requests = 0
        self.ok = 0
        self.client_errors = 0
        self.rejected_full = 0
        self.backend_errors = 0
        self.batches = 0
        self.items = 0
        self.backend_seconds = 0.0
        self.batch_sizes: Counter[int] = Counter()
        self.max_queue_depth = 0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "ok": self.ok, "client_errors": self.client_errors,
            "rejected_queue_full": self.rejected_full, "backend_errors": self.backend_errors,
            "batches": self.batches, "items": self.items,
            "mean_batch_size": self.items / self.batches if self.batches else 0.0,
            "max_batch_size": max(self.batch_sizes, default=0),
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "backend_seconds": self.backend_seconds, "max_queue_depth": self.max_queue_depth,
        }


class Batcher:
    """Bounded queue + one batching worker per pipeline (device)."""

    def __init__(self, cfg: ServerConfig, pipelines: Sequence[SpeechPipeline], stats: Stats):
        self.cfg = cfg
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

    def submit(self, codes: list[int], text: str) -> asyncio.Future:
        if len(self.queue) >= self.cfg.max_queue:
            self.stats.rejected_full += 1
            raise RequestError(f"queue full ({self.cfg.max_queue} waiting); retry later", 503)
        loop = asyncio.get_running_loop()
        item = Item(codes, text, loop.create_future(), loop.time())
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
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(pool, score_batch, pipeline, self.cfg,
                                                     [it.codes for it in batch], [it.text for it in batch])
            except Exception as e:  # a backend failure answers 500 to this batch only
                log.exception("backend %s failed on a batch of %d", pipeline.name, len(batch))
                self.stats.backend_errors += len(batch)
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(e)
                continue
            finally:
                self.stats.backend_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.items += len(batch)
            self.stats.batch_sizes[len(batch)] += 1
            for it, r in zip(batch, results):
                if not it.future.done():  # the client may have gone away
                    it.future.set_result(r)


def score_batch(pipeline: SpeechPipeline, cfg: ServerConfig, codes: list[list[int]],
                texts: list[str]) -> list[Result]:
    """Transcribe a batch and turn each transcript into a reward (runs in a worker thread)."""
    from ttsrl.text import compute_reward

    transcripts = pipeline.transcribe_tokens(codes, texts)
    out = []
    for c, text, tr in zip(codes, texts, transcripts):
        if len(c) == 0:  # nothing was said: reward 0 by definition
            out.append(Result(0.0, 1.0, ""))
            continue
        r = compute_reward(cfg.reward, text, tr.text, asr_logprob=tr.asr_logprob,
                           n_tokens=len(c) if cfg.length_guard else None, token_rate=pipeline.token_rate)
        reward = float(r.reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward {cfg.reward} gave {reward} for {text!r}")
        out.append(Result(reward, float(r.error_rate), tr.text))
    return out


# ---------------------------------------------------------------------------
# HTTP


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(text=json.dumps(obj, ensure_ascii=False), status=status,
                        content_type="application/json", headers=headers)


def _error(message: str, status: int, headers: dict | None = None) -> web.Response:
    return _json({"error": message}, status, headers)


class RewardServer:
    """The aiohttp application around a :class:`Batcher`."""

    def __init__(self, cfg: ServerConfig, pipelines: Sequence[SpeechPipeline] | None = None,
                 pipeline_factory: Callable[[str], SpeechPipeline] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.stats = Stats()
        self._given = list(pipelines) if pipelines else None
        self._factory = pipeline_factory or (lambda dev: build_pipeline(cfg.backend, dev))
        self.pipelines: list[SpeechPipeline] = []
        self.batcher: Batcher | None = None
        self.ready = False

    # ---- lifecycle -------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        name = "{name}"
        app.add_routes([
            web.get("/v2", self._server_meta),
            web.get("/v2/health/live", self._live),
            web.get("/v2/health/ready", self._ready),
            web.get(f"/v2/models/{name}", self._model_meta),
            web.get(f"/v2/models/{name}/versions/{{version}}", self._model_meta),
            web.get(f"/v2/models/{name}/ready", self._model_ready),
            web.get(f"/v2/models/{name}/versions/{{version}}/ready", self._model_ready),
            web.get(f"/v2/models/{name}/stats", self._stats),
            web.post(f"/v2/models/{name}/infer", self._infer),
            web.post(f"/v2/models/{name}/versions/{{version}}/infer", self._infer),
        ])
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        if self._given is not None:
            self.pipelines = self._given
        else:
            devices = self.cfg.devices or local_devices()
            loop = asyncio.get_running_loop()
            # build replicas in threads: model loading must not block the loop
            self.pipelines = list(await asyncio.gather(
                *(loop.run_in_executor(None, self._factory, d) for d in devices)))
        if self.cfg.reward == "cer_nll" and not all(p.want_score for p in self.pipelines):
            raise ValueError("reward cer_nll needs an ASR that scores text (e.g. whisper) and want_score on")
        # warm up every replica (lazy imports, dictionaries, kernels) before saying ready
        await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(
            None, score_batch, p, self.cfg, [[0] * 10], ["你好"]) for p in self.pipelines))
        self.batcher = Batcher(self.cfg, self.pipelines, self.stats)
        self.batcher.start()
        self.ready = True
        log.info("reward server ready: %s, reward %s", ", ".join(p.name for p in self.pipelines), self.cfg.reward)

    async def _cleanup(self, app: web.Application) -> None:
        self.ready = False
        if self.batcher:
            await self.batcher.stop()

    # ---- middleware ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            self.stats.client_errors += e.status < 500
            headers = {"Retry-After": str(self.cfg.retry_after_s)} if e.status == 503 else None
            return _error(str(e), e.status, headers)
        except web.HTTPRequestEntityTooLarge:
            self.stats.client_errors += 1
            return _error(f"request body larger than {self.cfg.max_body_bytes} bytes", 413)
        except web.HTTPException as e:
            if e.status >= 400:
                self.stats.client_errors += e.status < 500
                return _error(e.reason or "error", e.status)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never crash on a request: answer 500 and log
            log.exception("unhandled error on %s", request.path)
            return _error(f"internal error: {type(e).__name__}: {e}", 500)

    # ---- handlers -------------------------------------------------------------
    def _check_model(self, request: web.Request) -> None:
        name = request.match_info["name"]
        if name != self.cfg.model_name:
            raise RequestError(f"unknown model {name!r}; this server serves {self.cfg.model_name!r}", 404)
        version = request.match_info.get("version")
        if version is not None and version != MODEL_VERSION:
            raise RequestError(f"unknown version {version!r} of {name}; available: {MODEL_VERSION}", 404)

    async def _server_meta(self, request):
        return _json({"name": "ttsrl-reward", "version": "1", "extensions": []})

    async def _live(self, request):
        return _json({"live": True})

    async def _ready(self, request):
        return _json({"ready": self.ready}, 200 if self.ready else 503)

    async def _model_ready(self, request):
        self._check_model(request)
        return _json({"name": self.cfg.model_name, "ready": self.ready}, 200 if self.ready else 503)

    async def _model_meta(self, request):
        self._check_model(request)
        return _json({
            "name": self.cfg.model_name, "versions": [MODEL_VERSION], "platform": "ttsrl",
            "backend": ", ".join(p.name for p in self.pipelines), "reward": self.cfg.reward,
            "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in INPUT_SPECS],
            "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in OUTPUT_SPECS],
            "max_batch_size": self.cfg.max_batch, "max_tokens": self.cfg.max_tokens,
        })

    async def _stats(self, request):
        self._check_model(request)
        d = self.stats.as_dict()
        d["queue_depth"] = len(self.batcher.queue) if self.batcher else 0
        d["replicas"] = [p.name for p in self.pipelines]
        return _json(d)

    async def _infer(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        self._check_model(request)
        if not self.ready or self.batcher is None:
            raise RequestError("server is not ready", 503)
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise RequestError(f"request body larger than {self.cfg.max_body_bytes} bytes", 413)
        body = await request.read()
        codes, text, rid, wanted = parse_infer_request(body, self.cfg.max_tokens)
        result: Result = await self.batcher.submit(codes, text)
        values = {"REWARDS": result.reward, "TRANSCRIPTS": result.transcript, "ERROR_RATES": result.error_rate}
        outputs = [{"name": n, "datatype": d, "shape": s, "data": [values[n]]}
                   for n, d, s in OUTPUT_SPECS if wanted is None or n in wanted]
        resp = {"model_name": self.cfg.model_name, "model_version": MODEL_VERSION, "outputs": outputs}
        if rid is not None:
            resp["id"] = rid
        self.stats.ok += 1
        return _json(resp)


# ---------------------------------------------------------------------------
# running


def run(cfg: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted (the CLI's entry point)."""
    server = RewardServer(cfg)

    async def main():
        runner = web.AppRunner(server.make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        announce(f"ttsrl reward server ready on http://{host}:{port} "
                 f"(model {cfg.model_name}, reward {cfg.reward}, {', '.join(p.name for p in server.pipelines)})")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except (ValueError, FileNotFoundError, ImportError, OSError) as e:  # start-up problems: say what, no trace
        raise SystemExit(f"reward server: cannot start: {type(e).__name__}: {e}") from None


class BackgroundServer:
    """A server on a loopback port in a background thread (tests, benchmarks)."""

    def __init__(self, cfg: ServerConfig, **server_kwargs):
        self.server = RewardServer(cfg, **server_kwargs)
        self.cfg = cfg
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        started = threading.Event()
        errors: list[BaseException] = []

        async def main():
            self._stop = asyncio.Event()
            runner = web.AppRunner(self.server.make_app(), access_log=None)
            try:
                await runner.setup()
                site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
                await site.start()
                self.port = runner.addresses[0][1]
            except BaseException as e:
                errors.append(e)
                started.set()
                await runner.cleanup()
                return
            started.set()
            await self._stop.wait()
            await runner.cleanup()

        def target():
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(main())
            self._loop.close()

        self._thread = threading.Thread(target=target, name="reward-server", daemon=True)
        self._thread.start()
        started.wait(120)
        if errors:
            raise errors[0]
        return self

    def __exit__(self, *exc) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread:
            self._thread.join(30)
