"""The reward server (stage 1): speech tokens -> audio -> ASR -> error rate -> reward.

The wire protocol (KServe v2 / Triton HTTP JSON) is ``ttsrl.reward.protocol``, and its reader of
requests ``ttsrl.reward.infer_request``; batching is
``ttsrl.reward.batching``; scoring is ``ttsrl.reward.scoring.score_codes`` (shared with the
evaluator). Every bad request gets a 4xx with ``{"error": message}``; an empty token
list gets reward 0 by definition; a full queue answers 503 with ``Retry-After``.

Speakers: a request without PROMPT_ID is voiced by the prompt the pipeline picks from its text
(``SpeechPipeline.prompt_for``); one with PROMPT_ID by that prompt of the pool (the stems of
``--prompt-dir``'s wavs; cosyvoice2/cosyvoice3), and its SIM (``--want-sim``/``--sim-weight``) is
measured against that prompt wav; ``--mos-weight`` adds the naturalness term of its DNSMOS OVRL
(MOS_OVRLS). An id the pool lacks is refused before it is queued (422, naming
it and how many ids the server knows); backends without a pool (sim, whisper) know none. When the
prompt folder also holds ``prompt_speech_tokens.jsonl`` (``scripts/prompt_tokens.py``'s, the speech
tokens stage 0 puts in zero-shot rows), every id in it must be a wav of the folder: the server
refuses to start otherwise, so rows cannot carry ids it cannot voice.

HTTP stack: aiohttp. It is maintained, already a dependency (verl's reward loop
uses it), runs the whole server on one asyncio loop with no per-request
framework validation (the KServe payload needs hand validation anyway), and lets
us cap the body size before it is read (``client_max_size``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from aiohttp import web

from ttsrl.cli import option
from ttsrl.data.prompt_pool import prompt_id_problem
from ttsrl.families import DEFAULT_FAMILY, FAMILIES, family
from ttsrl.jsonl import DataError
from ttsrl.limits import MAX_SPEECH_CODES, MAX_TEXT_CHARS, text_problem
from ttsrl.reward.backends import BackendConfig, SpeechPipeline, build_pipeline, local_devices
from ttsrl.reward.backends.base import prompt_pool_sha1, unknown_prompt_message
from ttsrl.reward.batching import Batcher, Stats
from ttsrl.reward.http_guard import ConnectionGuard, RepeatedErrors, default_max_connections
from ttsrl.reward.infer_request import RequestError, parse_infer
from ttsrl.reward.metrics import ServerMetrics, is_infer
from ttsrl.reward.protocol import (
    DEFAULT_HOST,
    DEFAULT_MODEL_NAME,
    DEFAULT_PORT,
    MODEL_VERSION,
    build_response,
    model_metadata,
    reward_range,
)
from ttsrl.reward.rewards import (
    REWARDS,
    WEIGHTS,
    check_weight,
    reward_choices_help,
    reward_variant,
    sim_weight_of,
    weights_help,
)
from ttsrl.reward.scoring import Scored, finish, score_codes
from ttsrl.reward.triton_admin import model_config, repository_index
from ttsrl.reward.triton_binary import EXTENSION, HEADER, encode_response

log = logging.getLogger("ttsrl.reward.server")


@dataclass
class ServerConfig:
    """The server's settings; each field is also an option of ``token2wav_asr_server.py``
    (the backend's are :class:`BackendConfig`'s own)."""
    backend: BackendConfig = option(default_factory=BackendConfig, cli=False, help="the speech backend (its own options)")
    host: str = option(DEFAULT_HOST, help="address to bind (127.0.0.1: this machine only)")
    port: int = option(DEFAULT_PORT, help="port (0 = any free port, printed when ready)")
    model_name: str = option(DEFAULT_MODEL_NAME, help="model name in the URL")
    reward: str = option("tanh", choices=REWARDS, help="reward variant: " + reward_choices_help())
    length_guard: bool = option(True, flag="--no-length-guard", negated=True,
                                help="do not lower rewards of speech much longer/shorter than the text needs")
    want_sim: bool = option(False, help="measure each utterance's speaker similarity to its prompt (cosine of "
                                        "the model folder's campplus embeddings) and return it as SIMS, without "
                                        "adding it to the reward (for logging, and for GRPO's --algorithm gdpo, "
                                        "which weighs it itself); needs a backend with a speaker model (cosyvoice2, "
                                        "cosyvoice3)")
    sim_weight: float = option(0.0, metavar="W",
                               help="reward = error-rate reward + W x SIM (GLM-TTS uses 0.1; implies --want-sim; "
                                    "needs a backend with a speaker model; 0: the error-rate reward alone)")
    weights: str | None = option(None, choices=WEIGHTS, help="a named weighting of the combined reward, which sets "
                                                            "the SIM weight: " + weights_help())
    mos_weight: float = option(0.0, metavar="W",
                               help="add W x (DNSMOS OVRL - 1)/4, clipped to [0, 1], to the reward (naturalness; "
                                    "measures DNSMOS P.835 of every utterance and returns OVRL as MOS_OVRLS when asked; "
                                    "needs a backend that makes a waveform: not sim; 0: no naturalness term)")
    max_batch: int = option(32, help="most requests in one backend batch")
    max_delay_ms: float = option(10.0, help="longest wait after the oldest queued request before a batch runs")
    max_queue: int = option(4096, help="requests that may wait; beyond it the server answers 503 + Retry-After")
    max_body_bytes: int = option(1 << 20, help="largest request body (413 above)")
    family: str = option(DEFAULT_FAMILY.name, choices=tuple(FAMILIES),
                         help="the model family whose speech codes requests carry (MODEL_FAMILY): codes are checked "
                              "against its speech vocabulary; run.sh always passes it, and the default is the "
                              "family registry's default (ttsrl.families.DEFAULT_FAMILY)")
    max_tokens: int = option(MAX_SPEECH_CODES,  # CosyVoice2: 25/s -> 164 s
                             help="most speech codes per sequence (413 above)")
    max_text_chars: int = option(MAX_TEXT_CHARS, cli=False, help="characters of GT_TEXT (ttsrl.limits)")
    devices: tuple[str, ...] | None = option(None, help="comma-separated devices, one backend replica each "
                                                        "(none: all GPUs, else cpu)")
    retry_after_s: int = option(1, cli=False, help="Retry-After of a 503")
    max_connections: int = option(0, help="open connections at most; beyond it the longest-idle one is closed "
                                          "(0 = half the file-descriptor limit, at most 1024)")
    idle_timeout_s: float = option(10.0, help="close a connection that sends no complete request headers for this "
                                              "long (also idle keep-alive connections)")
    body_timeout_s: float = option(30.0, help="answer 408 when a request body takes longer than this")
    log_level: str = option("INFO", help="logging level of the server's log (DEBUG, INFO, WARNING, ...)")

    def validate(self) -> None:
        reward_variant(self.reward)  # ValueError naming the choices
        for name in ("max_batch", "max_queue", "max_body_bytes", "max_tokens", "max_text_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_delay_ms < 0 or self.max_connections < 0:
            raise ValueError("max_delay_ms and max_connections must be >= 0")
        if self.idle_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("idle_timeout_s and body_timeout_s must be > 0")
        check_weight("sim_weight", self.sim_weight)
        check_weight("mos_weight", self.mos_weight)
        if self.weights is not None:  # the named weighting sets the weight; a different explicit one is refused
            self.sim_weight = sim_weight_of(self.weights, self.sim_weight or None)
        self.backend.validate()

    @property
    def measures_sim(self) -> bool:
        return self.want_sim or self.sim_weight > 0

    @property
    def measures_mos(self) -> bool:
        return self.mos_weight > 0


# ---------------------------------------------------------------------------
# HTTP


class ClientGone(Exception):
    """The connection closed while its request body was being read."""


CLIENT_GONE = 499  # the status nginx logs for it: nobody receives the answer


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
        self.metrics = ServerMetrics(cfg.max_batch)
        self.metrics.watch(lambda: len(self.batcher.queue) if self.batcher else 0,
                           lambda: len(self.guard.conns) if self.guard else 0)
        self._given = list(pipelines) if pipelines else None
        backend = self.backend_config(cfg)
        self._factory = pipeline_factory or (lambda dev: build_pipeline(backend, dev))
        self.pipelines: list[SpeechPipeline] = []
        self.batcher: Batcher | None = None
        self.ready = False
        self.errors = RepeatedErrors(log)
        self.guard: ConnectionGuard | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._flusher: asyncio.Task | None = None

    @staticmethod
    def backend_config(cfg: ServerConfig) -> BackendConfig:
        """``cfg.backend`` with what the reward needs of it turned on (the ASR's log-probability)."""
        return replace(cfg.backend, want_score=cfg.backend.want_score or reward_variant(cfg.reward).needs_asr_logprob)

    # ---- serving ---------------------------------------------------------------
    async def start(self) -> tuple[str, int]:
        """Set the app up (load and warm the backends), listen; returns (host, port)."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self.errors.loop_handler)  # e.g. accept() EMFILE: once, counted
        self._runner = web.AppRunner(self.make_app(), access_log=None)
        await self._runner.setup()
        self.guard = ConnectionGuard(self._runner.server, self.cfg.max_connections or default_max_connections(),
                                     self.cfg.idle_timeout_s)
        self._listener = await loop.create_server(self.guard, self.cfg.host, self.cfg.port, reuse_address=True)
        self.guard.start()
        self._flusher = loop.create_task(self.errors.run())
        host, port = self._listener.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self.guard is not None:
            await self.guard.stop()
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self.errors.flush()

    # ---- lifecycle -------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes,
                              middlewares=[self.metrics.middleware, self._errors])
        name = "{name}"
        app.add_routes([
            web.get("/v2", self._server_meta),
            web.get("/v2/health/live", self._live),
            web.get("/v2/health/ready", self._ready),
            web.get("/v2/models/stats", self._stats),  # every model's (before {name} takes "stats")
            web.post("/v2/repository/index", self._repository_index),
            web.get(f"/v2/models/{name}", self._model_meta),
            web.get(f"/v2/models/{name}/versions/{{version}}", self._model_meta),
            web.get(f"/v2/models/{name}/ready", self._model_ready),
            web.get(f"/v2/models/{name}/versions/{{version}}/ready", self._model_ready),
            web.get(f"/v2/models/{name}/stats", self._stats),
            web.get(f"/v2/models/{name}/versions/{{version}}/stats", self._stats),
            web.get(f"/v2/models/{name}/config", self._model_config),
            web.get(f"/v2/models/{name}/versions/{{version}}/config", self._model_config),
            web.get("/metrics", self.metrics.handle),
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
        if reward_variant(self.cfg.reward).needs_asr_logprob and not all(p.want_score for p in self.pipelines):
            raise ValueError(f"reward {self.cfg.reward} needs the ASR's log-probability of the reference text: "
                             "an ASR that scores text (e.g. whisper) and want_score on")
        if self.cfg.measures_sim:
            self._measure_sim()
        if self.cfg.measures_mos:
            self._measure_mos()
        self._check_prompt_pool()
        # warm up every replica (lazy imports, dictionaries, kernels) before saying ready
        await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(
            None, self.score, p, [[0] * 10], ["你好"]) for p in self.pipelines))
        self.batcher = Batcher(self.cfg, self.pipelines, self.stats, self._score_counted, self.errors,
                               on_split=self.metrics.batches_split.inc)
        self.batcher.start()
        self.ready = True
        log.info("reward server ready: %s, reward %s%s%s", ", ".join(p.name for p in self.pipelines), self.cfg.reward,
                 f", SIM weight {self.cfg.sim_weight:g}" if self.cfg.measures_sim else "",
                 f", MOS weight {self.cfg.mos_weight:g}" if self.cfg.measures_mos else "")

    def _measure_sim(self) -> None:
        """Turn on speaker similarity in every replica; refuse a backend without a speaker model."""
        lacking = sorted({p.token2wav.name for p in self.pipelines if not p.token2wav.has_speaker_model})
        if lacking:
            asked = f"--sim-weight {self.cfg.sim_weight:g}" if self.cfg.sim_weight > 0 else "--want-sim"
            raise ValueError(f"{asked} needs a speaker model, and backend {', '.join(lacking)} has none "
                             "(cosyvoice2 and cosyvoice3 have one: campplus.onnx; kokoro: Resemblyzer); start without it")
        for p in self.pipelines:
            p.want_sim = True

    def _measure_mos(self) -> None:
        """Give every replica a DNSMOS (as the pipeline's ``want_mos`` does); refuse a backend whose
        audio has no waveform, which DNSMOS cannot hear (its MOS term would be 0 on every rollout)."""
        lacking = sorted({p.token2wav.name for p in self.pipelines if not p.token2wav.has_waveform})
        if lacking:
            raise ValueError(f"--mos-weight {self.cfg.mos_weight:g} needs audio with a waveform, and backend "
                             f"{', '.join(lacking)} makes none (every other backend does); start without it")
        from ttsrl.reward.backends.naturalness import DNSMOS

        for p in self.pipelines:
            if p.naturalness is None:
                p.naturalness = DNSMOS(self.cfg.backend.cpu_threads)

    @property
    def prompt_ids(self) -> list[str]:
        """The prompt ids a request may name (PROMPT_ID), sorted: the replicas' common pool."""
        return sorted(self.pipelines[0].token2wav.prompt_pool) if self.pipelines else []

    def _check_prompt_pool(self) -> None:
        """Every replica knows the same ids; the ids of the prompt folder's prompt_speech_tokens.jsonl
        (when there is one) are all wavs of the folder."""
        pools = {p.name: sorted(p.token2wav.prompt_pool) for p in self.pipelines}
        if len({tuple(v) for v in pools.values()}) > 1:
            raise ValueError(f"the replicas know different prompt ids: {pools}")
        folder = self.cfg.backend.prompt_dir
        ids = set(self.prompt_ids)
        # the one id rule (ttsrl.data.prompt_pool): an id it breaks would be refused (400) on every
        # request naming it, so a pool holding one does not start
        bad = [f"{i!r} {why}" for i in sorted(ids) if (why := prompt_id_problem(i))]
        if bad:
            raise ValueError(f"--prompt-dir {folder}: {len(bad)} prompt id(s) break the id rule, e.g. "
                             f"{'; '.join(bad[:3])} (rename the wavs / fix the pool's ids: stage 0 and "
                             "scripts/check_inputs.py apply the same rule)")
        if not folder or not ids:
            return
        from pathlib import Path

        from ttsrl.data.testsets import PROMPT_TOKENS_FILE
        from ttsrl.jsonl import iter_objects

        listed = Path(folder) / PROMPT_TOKENS_FILE
        if not listed.is_file():
            return
        named = [str(obj.get("id")) for _, obj in iter_objects(listed, ValueError)]
        lacking = [i for i in named if i not in ids]
        if lacking:
            raise ValueError(f"{listed} lists {len(lacking)} prompt id(s) with no wav of that stem in {folder} "
                             f"(e.g. {lacking[:3]}); the prompt pool's ids are its wavs' stems (scripts/prompt_tokens.py "
                             "on a list of the wav paths writes them so)")

    def check_prompt_id(self, prompt_id: str) -> None:
        """RequestError 422 for an id this server's pool lacks (naming it and how many ids it knows)."""
        t2w = self.pipelines[0].token2wav
        if prompt_id not in t2w.prompt_pool:
            raise RequestError(f"input PROMPT_ID: {unknown_prompt_message(prompt_id, t2w.name, self.prompt_ids)}", 422)

    def _sim_output(self, sim: float | None) -> float | None:
        """SIMS of one reply: None (left out) when this server does not measure it, NaN when
        it does but nothing was voiced."""
        if not self.cfg.measures_sim:
            return None
        return math.nan if sim is None else sim

    def score(self, pipeline: SpeechPipeline, codes: list[list[int]], texts: list[str],
              prompt_ids: list[str | None] | None = None) -> list[Scored]:
        """Score one batch (runs in a worker thread); ``prompt_ids[i]``: item i's PROMPT_ID or None."""
        return score_codes(pipeline, codes, texts, reward=self.cfg.reward, length_guard=self.cfg.length_guard,
                           sim_weight=self.cfg.sim_weight, mos_weight=self.cfg.mos_weight, prompt_ids=prompt_ids)

    def _score_counted(self, pipeline: SpeechPipeline, codes: list[list[int]], texts: list[str],
                       prompt_ids: list[str | None] | None = None) -> list[Scored]:
        """:meth:`score` for the batcher: a scored batch goes into the metrics."""
        t0 = time.perf_counter()
        out = self.score(pipeline, codes, texts, prompt_ids)
        self.metrics.observe_batch(len(codes), time.perf_counter() - t0, getattr(pipeline, "last_stage_seconds", {}))
        return out

    async def _cleanup(self, app: web.Application) -> None:
        self.ready = False
        if self.batcher:
            await self.batcher.stop()

    # ---- middleware ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every exception a handler raises becomes an answer; each infer request is counted once
        in /stats by the status it is answered with (so /stats and /metrics count the same
        requests, and requests = ok + client_errors + unavailable + server_errors + client_gone)."""
        transport = request.transport
        if self.guard is not None:
            self.guard.enter(transport)
        try:
            resp = await self._answer_or_error(request, handler)
        finally:
            if self.guard is not None:
                self.guard.leave(transport)
        if is_infer(request):
            self.stats.answered(resp.status)
        return resp

    async def _answer_or_error(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ClientGone:  # nobody to answer: neither a client error nor the server's fault
            return _error("the client went away before its request was read", CLIENT_GONE)
        except RequestError as e:
            headers = {"Retry-After": str(self.cfg.retry_after_s)} if e.status == 503 else None
            resp = _error(str(e), e.status, headers)
            if e.status == 408:  # the rest of that body is not worth waiting for
                resp.force_close()
            return resp
        except web.HTTPRequestEntityTooLarge:
            return _error(f"request body larger than {self.cfg.max_body_bytes} bytes", 413)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.reason or "error", e.status)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never crash on a request: answer 500 and log (a repeat: counted)
            what = f"{type(e).__name__}: {e}"[:300]
            self.errors.error(f"500 on {request.path}: {what}", "unhandled error on %s", request.path, exc_info=e)
            return _error(f"internal error: {what}", 500)

    # ---- handlers -------------------------------------------------------------
    def _check_model(self, request: web.Request) -> None:
        name = request.match_info.get("name", self.cfg.model_name)  # /v2/models/stats: every model
        if name != self.cfg.model_name:
            raise RequestError(f"unknown model {name!r}; this server serves {self.cfg.model_name!r}", 404)
        version = request.match_info.get("version")
        if version is not None and version != MODEL_VERSION:
            raise RequestError(f"unknown version {version!r} of {name}; available: {MODEL_VERSION}", 404)

    async def _server_meta(self, request):
        return _json({"name": "ttsrl-reward", "version": "1", "pid": os.getpid(),  # run.sh adopts by it
                      "extensions": [EXTENSION, "model_configuration", "statistics"]})

    async def _live(self, request):
        return _json({"live": True})

    async def _ready(self, request):
        return _json({"ready": self.ready}, 200 if self.ready else 503)

    async def _model_ready(self, request):
        self._check_model(request)
        return _json({"name": self.cfg.model_name, "ready": self.ready}, 200 if self.ready else 503)

    async def _model_meta(self, request):
        self._check_model(request)
        meta = model_metadata(self.cfg.model_name)
        b = self.cfg.backend
        meta.update(platform="ttsrl", backend=", ".join(p.name for p in self.pipelines), reward=self.cfg.reward,
                    backend_name=b.backend, asr=b.asr, model_dir=b.model_dir, pid=os.getpid(),
                    max_batch_size=self.cfg.max_batch, max_tokens=self.cfg.max_tokens,
                    measures_sim=self.cfg.measures_sim, sim_weight=self.cfg.sim_weight,
                    measures_mos=self.cfg.measures_mos, mos_weight=self.cfg.mos_weight,
                    length_guard=self.cfg.length_guard, family=self.cfg.family,
                    reward_range=list(reward_range(self.cfg.sim_weight, self.cfg.mos_weight)),
                    prompt_ids=len(self.prompt_ids), prompt_pool_sha1=prompt_pool_sha1(self.prompt_ids))
        return _json(meta)

    async def _model_config(self, request):
        self._check_model(request)
        return _json(model_config(
            self.cfg.model_name, max_batch=self.cfg.max_batch, max_delay_ms=self.cfg.max_delay_ms,
            max_queue=self.cfg.max_queue, devices=[p.device for p in self.pipelines],
            parameters={"reward": self.cfg.reward, "backend": ", ".join(p.name for p in self.pipelines),
                        "sim_weight": f"{self.cfg.sim_weight:g}", "measures_sim": str(self.cfg.measures_sim).lower(),
                        "mos_weight": f"{self.cfg.mos_weight:g}",
                        "max_tokens": str(self.cfg.max_tokens), "model_dir": self.cfg.backend.model_dir,
                        "prompt_ids": str(len(self.prompt_ids)), "prompt_pool_sha1": prompt_pool_sha1(self.prompt_ids)}))

    async def _repository_index(self, request):
        return _json(repository_index(self.cfg.model_name, self.ready))

    async def _stats(self, request):
        """Triton's statistics schema (``model_stats``); ttsrl's own counters beside it at the top
        level, where tools that read Triton's ignore them."""
        self._check_model(request)
        d = {"model_stats": [self.stats.triton.model_stat(self.cfg.model_name)]}
        d.update(self.stats.as_dict())
        d["queue_depth"] = len(self.batcher.queue) if self.batcher else 0
        d["replicas"] = [p.name for p in self.pipelines]
        if self.guard is not None:
            d.update(self.guard.as_dict())
        return _json(d)

    async def _infer(self, request: web.Request) -> web.Response:
        self._check_model(request)
        t0 = time.perf_counter_ns()
        try:
            resp = await self._answer(request)
        except Exception:
            self.stats.triton.durations["fail"].add(time.perf_counter_ns() - t0)
            raise
        triton = self.stats.triton
        triton.durations["success"].add(time.perf_counter_ns() - t0)
        triton.inference_count += 1
        triton.last_inference_ms = int(time.time() * 1000)
        return resp

    async def _answer(self, request: web.Request) -> web.Response:
        """One inference request, parsed, scored and encoded."""
        if not self.ready or self.batcher is None:
            raise RequestError("server is not ready", 503)
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise RequestError(f"request body larger than {self.cfg.max_body_bytes} bytes", 413)
        if self.guard is not None:
            self.guard.reading(request.transport, True)
        try:
            body = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except asyncio.TimeoutError:  # answered with Connection: close (see _errors)
            raise RequestError(f"request body not received within {self.cfg.body_timeout_s:g} s", 408) from None
        except ConnectionResetError:  # the client hung up (or was evicted as the slowest reader)
            raise ClientGone() from None
        finally:
            if self.guard is not None:
                self.guard.reading(request.transport, False)
        t_parse = time.perf_counter_ns()
        req = parse_infer(body, self.cfg.max_tokens, request.headers.get(HEADER),
                          speech_token_size=family(self.cfg.family).speech_token_size)
        triton = self.stats.triton
        triton.durations["compute_input"].add(time.perf_counter_ns() - t_parse)
        why = text_problem(req.text, self.cfg.max_text_chars)
        if why:  # the same rule as stage 0 and the pair readers: never reaches a batch
            raise RequestError(f"input GT_TEXT: {why}", 422)
        if req.prompt_id is not None:  # never voiced by another speaker: refused before it is queued
            self.check_prompt_id(req.prompt_id)
        result: Scored = finish(await self.batcher.submit(req.codes, req.text, req.prompt_id), req.finished,
                                self.cfg.length_guard)
        t_out = time.perf_counter_ns()
        resp = build_response(self.cfg.model_name, result.reward, result.transcript, result.error_rate,
                              req.rid, req.wanted, self._sim_output(result.sim), self.cfg.sim_weight,
                              self.cfg.reward, req.prompt_id, result.cer_term, result.length_term,
                              None if result.mos is None else result.mos.ovrl, self.cfg.mos_weight)
        data, json_length = encode_response(resp, req.binary_outputs)
        triton.durations["compute_output"].add(time.perf_counter_ns() - t_out)
        if json_length is None:  # nothing asked for in binary: plain JSON
            return web.Response(body=data, content_type="application/json", charset="utf-8")
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={HEADER: str(json_length)})


# ---------------------------------------------------------------------------
# running


def run(cfg: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted (the CLI's entry point)."""
    server = RewardServer(cfg)

    async def main():
        try:
            host, port = await server.start()
            announce(f"ttsrl reward server ready on http://{host}:{port} "
                     f"(model {cfg.model_name}, reward {cfg.reward}, {', '.join(p.name for p in server.pipelines)})")
            await asyncio.Event().wait()
        finally:
            await server.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except DataError as e:  # a bad input file (a pool): its message names FILE:LINE, a traceback would bury it
        print(f"reward server: cannot start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
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
            try:
                self.port = (await self.server.start())[1]
            except BaseException as e:
                errors.append(e)
                started.set()
                await self.server.close()
                return
            started.set()
            await self._stop.wait()
            await self.server.close()

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
