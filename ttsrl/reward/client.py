"""verl's reward function: post speech tokens to the reward server, never score a failure silently.

``compute_score`` is what ``reward_tts.py`` exposes to verl 0.9.1
(``reward.custom_reward_function.path=reward_tts.py``, ``.name=compute_score``).
It is ``async``: verl's naive reward-loop manager awaits one call per response and
gathers a whole chunk of a step at once, so the requests reach the server together
and the server batches them.

Failure policy
--------------
A call retries connection errors, timeouts, 5xx and 503 (queue full; honouring
``Retry-After``) with exponential backoff. 4xx answers are not retried (the request
itself is wrong). A call that still fails is counted; then:

* if the failures of the current step exceed ``max_fail_fraction`` of the calls of
  that step, the call raises :class:`RewardServiceError`, which fails verl's
  ``asyncio.gather`` and with it the training step, loudly;
* otherwise the sample gets score 0.0 with ``reward_failed = 1.0`` in its extra info
  (verl logs extra keys) and a warning is printed, so it is visible, not silent.

What is a "step" for a per-sample function? verl gives no step id to
``compute_score``, but it does call it in bursts: each reward worker process creates
all tasks of its chunk of a step at once and awaits them together, and the next
step's burst comes only after training. So :class:`StepWindow` treats a *burst* as
the step: a window opens when a call starts while none is in flight and none ended
in the last ``step_gap_s`` seconds; every call started while it is open belongs to
it. Because the whole chunk has started before the first call can fail (even a
dead port fails only after its retries), ``failed / started`` at the time of a
failure is the fraction of the step. A caller that scores samples one by one (the
old synchronous manager) sees windows of one call, so any failure raises: the safe
direction. The window is per process, which matches verl (one window per reward
worker, each judging its own share of the step).

Keys of the returned dict are the same for every sample (verl builds its extra-info
columns from the first sample's keys): ``score``, ``error_rate``, ``transcript``
(a string; verl's metric code skips strings) and ``reward_failed``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterable

import aiohttp

from ttsrl import knobs
from ttsrl.model.vocab import SpeechVocab
from ttsrl.reward.protocol import (
    DEFAULT_MODEL_NAME,
    DEFAULT_URL,
    ResponseError,
    build_payload,
    infer_path,
    parse_response,
)

log = logging.getLogger("ttsrl.reward")

ENV_URL = "TTSRL_REWARD_URL"
ENV_MODEL = "TTSRL_REWARD_MODEL"
ENV_MAX_FAIL = "TTSRL_REWARD_MAX_FAIL_FRACTION"
ENV_RETRIES = "TTSRL_REWARD_RETRIES"
ENV_BACKOFF = "TTSRL_REWARD_BACKOFF_S"
ENV_TIMEOUT = "TTSRL_REWARD_TIMEOUT_S"
ENV_STEP_GAP = "TTSRL_REWARD_STEP_GAP_S"
ENV_MAX_CONN = "TTSRL_REWARD_MAX_CONNECTIONS"

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class RewardServiceError(RuntimeError):
    """Too many rewards of a step could not be computed: the step must not train on them."""


class RequestFailed(Exception):
    """One reward request failed for good (after retries, or a non-retryable answer).
    ``refused``: the server answered 4xx, i.e. the request itself is wrong and sending
    it again gives the same answer (it is never retried)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class RewardClientConfig:
    """Defaults and meanings: the reward client's knobs in ttsrl/knobs.py (from_env reads them)."""

    url: str = DEFAULT_URL
    model: str = DEFAULT_MODEL_NAME
    max_fail_fraction: float = knobs.default(ENV_MAX_FAIL)
    retries: int = knobs.default(ENV_RETRIES)  # attempts after the first
    backoff_s: float = knobs.default(ENV_BACKOFF)  # first retry delay; doubles each retry (capped at 30 s), jitter
    timeout_s: float = knobs.default(ENV_TIMEOUT)  # per attempt
    step_gap_s: float = knobs.default(ENV_STEP_GAP)  # idle time that closes a step window
    max_connections: int = knobs.default(ENV_MAX_CONN)  # concurrent requests per event loop

    @classmethod
    def from_env(cls) -> "RewardClientConfig":
        g = knobs.get
        cfg = cls(url=(g(ENV_URL) or DEFAULT_URL).rstrip("/"), model=g(ENV_MODEL) or DEFAULT_MODEL_NAME,
                  max_fail_fraction=g(ENV_MAX_FAIL), retries=g(ENV_RETRIES), backoff_s=g(ENV_BACKOFF),
                  timeout_s=g(ENV_TIMEOUT), step_gap_s=g(ENV_STEP_GAP), max_connections=g(ENV_MAX_CONN))
        if not 0.0 <= cfg.max_fail_fraction <= 1.0:
            raise ValueError(f"{ENV_MAX_FAIL} must be in [0, 1], got {cfg.max_fail_fraction}")
        if cfg.retries < 0 or cfg.backoff_s < 0 or cfg.timeout_s <= 0 or cfg.max_connections < 1:
            raise ValueError("reward client: retries/backoff must be >= 0, timeout > 0, max connections >= 1")
        return cfg

    @property
    def infer_url(self) -> str:
        return self.url + infer_path(self.model)


# ---------------------------------------------------------------------------
# step windows


class StepWindow:
    """Counts calls and failures of the current burst of calls (see the module doc)."""

    def __init__(self, gap_s: float = 1.0, clock=time.monotonic):
        self.gap_s = gap_s
        self._clock = clock
        self._lock = threading.Lock()
        self.window = 0
        self.started = 0
        self.failed = 0
        self.in_flight = 0
        self._last_end = -math.inf

    def begin(self) -> int:
        with self._lock:
            if self.in_flight == 0 and self._clock() - self._last_end > self.gap_s:
                self.window += 1
                self.started = self.failed = 0
            self.in_flight += 1
            self.started += 1
            return self.window

    def end(self, window: int, failed: bool) -> tuple[int, int]:
        """Close one call; returns (failed, started) of its window so far."""
        with self._lock:
            self.in_flight -= 1
            self._last_end = self._clock()
            if window != self.window:  # a straggler from an older window
                return int(failed), 1
            self.failed += int(failed)
            return self.failed, self.started


_WINDOW: StepWindow | None = None
_WINDOW_LOCK = threading.Lock()


def step_window(gap_s: float) -> StepWindow:
    global _WINDOW
    with _WINDOW_LOCK:
        if _WINDOW is None:
            _WINDOW = StepWindow(gap_s)
        _WINDOW.gap_s = gap_s
        return _WINDOW


# ---------------------------------------------------------------------------
# HTTP


_SEMAPHORES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _semaphore(n: int) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    sem = _SEMAPHORES.get(loop)
    if sem is None:
        sem = _SEMAPHORES[loop] = asyncio.Semaphore(n)
    return sem


async def request_reward(codes: list[int], text: str, cfg: RewardClientConfig) -> tuple[float, float, str]:
    """One reward from the server, with retries; raises :class:`RequestFailed`."""
    payload = build_payload(codes, text)
    last = "no attempt made"
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with _semaphore(cfg.max_connections):
        for attempt in range(cfg.retries + 1):
            retry_after = None
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(cfg.infer_url, json=payload) as resp:
                        if resp.status == 200:
                            try:
                                return parse_response(await resp.json(content_type=None))
                            except ResponseError as e:
                                raise RequestFailed(str(e)) from None
                        detail = (await resp.text())[:300]
                        last = f"HTTP {resp.status} from {cfg.infer_url}: {detail}"
                        if resp.status not in RETRYABLE_STATUS:
                            raise RequestFailed(last, refused=400 <= resp.status < 500)
                        ra = resp.headers.get("Retry-After")
                        retry_after = float(ra) if ra and ra.replace(".", "", 1).isdigit() else None
            except RequestFailed:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                last = f"{type(e).__name__} talking to {cfg.infer_url}: {e}"
            if attempt < cfg.retries:
                delay = min(30.0, cfg.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                await asyncio.sleep(max(delay, retry_after or 0.0))
    raise RequestFailed(f"{last} (after {cfg.retries + 1} attempts)")


# ---------------------------------------------------------------------------
# verl entry point

_warned_empty = False


def _result(score: float, error_rate: float, transcript: str, failed: bool) -> dict:
    return {"score": float(score), "error_rate": float(error_rate), "transcript": transcript,
            "reward_failed": 1.0 if failed else 0.0}


async def compute_score(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict | None = None, *, config: RewardClientConfig | None = None,
                        **kwargs) -> dict:
    """Reward of one generated response (a string of ``<|s_N|>`` tokens) for ``ground_truth``."""
    global _warned_empty
    cfg = config or RewardClientConfig.from_env()
    try:
        codes = SpeechVocab.parse_speech_text(solution_str or "")
    except ValueError as e:  # not a speech sequence at all: it says nothing
        log.warning("response is not valid speech (%s); reward 0", e)
        return _result(0.0, 1.0, "", False)
    if not codes:
        if not _warned_empty:
            _warned_empty = True
            log.warning("a response holds no <|s_N|> speech tokens (reward 0 by definition). If EVERY "
                        "response is empty, the tokenizer probably marks speech tokens special and verl "
                        "decodes with skip_special_tokens=True, which drops them.")
        return _result(0.0, 1.0, "", False)

    window = step_window(cfg.step_gap_s)
    wid = window.begin()
    try:
        reward, err, transcript = await request_reward(codes, ground_truth, cfg)
    except RequestFailed as e:
        failed, started = window.end(wid, True)
        if failed > cfg.max_fail_fraction * started:
            hint = (f"The server refused that request as invalid (not retried): check the text {ground_truth[:80]!r} "
                    "of the data (prepare_data.py flags texts the reward cannot read)." if e.refused else
                    f"Is the reward server at {cfg.url} ({ENV_URL}) up and serving model {cfg.model!r}?")
            raise RewardServiceError(
                f"{failed} of {started} reward requests of this step failed (limit "
                f"{cfg.max_fail_fraction:.0%}, {ENV_MAX_FAIL}); last error: {e}. {hint}") from e
        log.warning("reward request failed (%d of %d this step, within the %.0f%% limit); "
                    "scoring this sample 0 and flagging reward_failed: %s",
                    failed, started, 100 * cfg.max_fail_fraction, e)
        return _result(0.0, 1.0, "", True)
    except BaseException:
        window.end(wid, True)
        raise
    window.end(wid, False)
    return _result(reward, err, transcript, False)


async def score_all(rows: Iterable[tuple[list[int], str]], config: RewardClientConfig | None = None) -> list[dict]:
    """Score (codes, text) pairs concurrently, like one verl step."""
    cfg = config or RewardClientConfig.from_env()
    tasks = [compute_score("cli", SpeechVocab.codes_to_text(codes), text, config=cfg) for codes, text in rows]
    return list(await asyncio.gather(*tasks))
