"""verl's reward function: post speech tokens to the reward server, never score a failure silently.

``compute_score`` is what ``reward_tts.py`` exposes to verl (``reward.custom_reward_function``).
It is ``async``: verl awaits one call per response as soon as its generation ends; the calls of a
process that overlap share one HTTP session and reach the server together, and the server batches
them. ``TTSRL_REWARD_URL`` names one server or several (``ttsrl.reward.pool``); a 4xx is not retried.

A request that still fails is counted: the sample scores 0.0 with ``reward_failed`` 1.0 and a
warning, until more than ``max_fail_fraction`` of this process's last ``fail_window`` requests
failed; then the call raises :class:`RewardServiceError`, and verl drops that rollout from its
group. The window counts requests, not steps, because verl gives no step id and scores samples one
at a time (docs/architecture.md, "The reward function's failures"); the step's own count, which stops
a run whose step lost more than the same share of its rewards, is the trainer's
(``ttsrl.verl_plugin.reward_metrics``).

Every sample's dict has the same keys, all finite (verl builds its columns from the first sample's):
``score``, the reward's terms ``cer``, ``sim``, ``length`` (``TERM_KEYS``: gdpo's components),
``unfinished``, ``error_rate``, ``transcript``, ``reward_failed`` and ``sim_measured`` (1.0 or 0.0:
tells a measured SIM from the 0.0 of none), ``mos`` (DNSMOS OVRL, 1..5, of a server with a MOS weight)
and ``mos_measured`` (likewise). A zero-shot row's ``extra_info["prompt_id"]`` is sent as
PROMPT_ID, so the response is voiced, and its SIM measured, with the prompt the policy continued.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from ttsrl import knobs
from ttsrl.model.vocab import SpeechVocab, parse_speech_text
from ttsrl.reward.pool import EndpointPool, Policy, RequestFailed, pool_for
from ttsrl.reward.protocol import (
    CLIENT_OUTPUTS,
    DEFAULT_MODEL_NAME,
    DEFAULT_URL,
    Reply,
    build_payload,
    infer_path,
    parse_response,
    split_urls,
)

__all__ = ["RequestFailed", "RewardClientConfig", "RewardServiceError", "FailureWindow", "compute_score",
           "request_reward", "score_all"]

log = logging.getLogger("ttsrl.reward")

PROMPT_ID_KEY = "prompt_id"  # the verl row's extra_info key naming its speaker prompt
ENV_URL = "TTSRL_REWARD_URL"
ENV_MODEL = "TTSRL_REWARD_MODEL"
ENV_MAX_FAIL = "TTSRL_REWARD_MAX_FAIL_FRACTION"
ENV_FAIL_WINDOW = "TTSRL_REWARD_FAIL_WINDOW"
ENV_RETRIES = "TTSRL_REWARD_RETRIES"
ENV_BACKOFF = "TTSRL_REWARD_BACKOFF_S"
ENV_TIMEOUT = "TTSRL_REWARD_TIMEOUT_S"
ENV_MAX_CONN = "TTSRL_REWARD_MAX_CONNECTIONS"


class RewardServiceError(RuntimeError):
    """Too many of the recent rewards could not be computed: the step must not train on them."""


@dataclass
class RewardClientConfig:
    """Defaults and meanings: the reward client's knobs in ttsrl/knobs.py (from_env reads them)."""

    url: str = DEFAULT_URL  # one base URL or a comma-separated list (see ``urls``)
    model: str = DEFAULT_MODEL_NAME
    reward: str | None = None  # the reward variant asked for: an answer scored by another is refused
    sim_weight: float | None = None  # the SIM weight asked for: an answer combined with another is refused
    mos_weight: float | None = None  # the MOS weight asked for: likewise
    max_response_length: int | None = None  # the rollout's response budget: a response this long never ended
    max_fail_fraction: float = knobs.default(ENV_MAX_FAIL)
    fail_window: int = knobs.default(ENV_FAIL_WINDOW)  # the fraction is judged over this process's last this-many requests
    retries: int = knobs.default(ENV_RETRIES)  # waits for a usable server when none is left (each up to the backoff)
    backoff_s: float = knobs.default(ENV_BACKOFF)  # a failed server's first time out of rotation; doubles per failure
    max_backoff_s: float = 30.0
    timeout_s: float = knobs.default(ENV_TIMEOUT)  # per attempt
    max_connections: int = knobs.default(ENV_MAX_CONN)  # concurrent requests per event loop

    @classmethod
    def from_env(cls, urls: str | None = None, reward: str | None = None, sim_weight: float | None = None,
                 max_response_length: int | None = None, mos_weight: float | None = None) -> "RewardClientConfig":
        """The configuration from the reward knobs of ``ttsrl.knobs`` (read here only); ``urls``,
        ``reward``, ``sim_weight``, ``max_response_length`` and ``mos_weight`` (verl's ``reward_kwargs``,
        which a run sets) win over the environment."""
        g = knobs.get
        cfg = cls(url=urls or g(ENV_URL) or DEFAULT_URL, model=g(ENV_MODEL) or DEFAULT_MODEL_NAME, reward=reward,
                  sim_weight=None if sim_weight is None else float(sim_weight),
                  mos_weight=None if mos_weight is None else float(mos_weight),
                  max_response_length=None if max_response_length is None else int(max_response_length),
                  max_fail_fraction=g(ENV_MAX_FAIL), fail_window=g(ENV_FAIL_WINDOW), retries=g(ENV_RETRIES),
                  backoff_s=g(ENV_BACKOFF), timeout_s=g(ENV_TIMEOUT), max_connections=g(ENV_MAX_CONN))
        try:
            cfg.url = ",".join(cfg.urls)
        except ValueError as e:
            raise ValueError(f"{ENV_URL}: {e}") from None
        if not 0.0 <= cfg.max_fail_fraction <= 1.0:
            raise ValueError(f"{ENV_MAX_FAIL} must be in [0, 1], got {cfg.max_fail_fraction}")
        if cfg.fail_window < 1:
            raise ValueError(f"{ENV_FAIL_WINDOW} must be >= 1, got {cfg.fail_window}")
        if cfg.max_response_length is not None and cfg.max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {cfg.max_response_length}")
        for name, weight in (("expect_sim_weight", cfg.sim_weight), ("expect_mos_weight", cfg.mos_weight)):
            if weight is not None and not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {weight}")
        if cfg.retries < 0 or cfg.backoff_s < 0 or cfg.timeout_s <= 0 or cfg.max_connections < 1:
            raise ValueError("reward client: retries/backoff must be >= 0, timeout > 0, max connections >= 1")
        return cfg

    @property
    def urls(self) -> tuple[str, ...]:
        return split_urls(self.url)

    @property
    def pool(self) -> EndpointPool:
        return pool_for(self.urls)

    @property
    def policy(self) -> Policy:
        return Policy(timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
                      max_backoff_s=self.max_backoff_s, max_connections=self.max_connections)


# ---------------------------------------------------------------------------
# the failure rule


class FailureWindow:
    """Outcomes of the last ``size`` reward requests (see the module doc); thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._outcomes: deque[bool] = deque(maxlen=size)
        self._lock = threading.Lock()

    def record(self, failed: bool) -> int:
        """Add one outcome; the number of failures among the last ``size``."""
        with self._lock:
            self._outcomes.append(failed)
            return sum(self._outcomes)


_WINDOWS: dict[tuple[tuple[str, ...], int], FailureWindow] = {}
_WINDOWS_LOCK = threading.Lock()


def failure_window(cfg: RewardClientConfig) -> FailureWindow:
    """This process's window for the servers of ``cfg``."""
    key = (cfg.urls, cfg.fail_window)
    with _WINDOWS_LOCK:
        if key not in _WINDOWS:
            _WINDOWS[key] = FailureWindow(cfg.fail_window)
        return _WINDOWS[key]


# ---------------------------------------------------------------------------
# one reward


async def request_reward(codes: list[int], text: str, cfg: RewardClientConfig, prompt_id: str | None = None,
                         finished: bool | None = None) -> Reply:
    """One reward (reward, error rate, transcript, sim, the terms) from the servers of ``cfg``; raises
    :class:`RequestFailed`. ``prompt_id``: the speaker prompt to voice it with (PROMPT_ID); an answer
    that does not carry it back (voiced by another speaker) is refused. ``finished``: FINISHED."""
    return await cfg.pool.post(infer_path(cfg.model), build_payload(codes, text, prompt_id, finished, CLIENT_OUTPUTS),
                               cfg.policy, accept=functools.partial(parse_response, model=cfg.model, reward=cfg.reward,
                                                                    prompt_id=prompt_id, sim_weight=cfg.sim_weight,
                                                                    mos_weight=cfg.mos_weight))


def is_finished(n_codes: int, max_response_length: int | None) -> bool | None:
    """Whether a response of ``n_codes`` speech codes ended with end of speech, for a rollout
    budget of ``max_response_length`` tokens (None: not known). verl 0.9.1 hands the reward
    function the decoded response only, with ``skip_special_tokens=True``
    (``experimental/reward_loop/reward_manager/naive.py:54-56``), and the stop tokens are special
    (``ttsrl.model.vocab``): ``solution_str`` never shows one. But the agent loop cuts every
    response to ``rollout.response_length`` (= ``data.max_response_length``,
    ``trainer/config/rollout/rollout.yaml:39``; ``experimental/agent_loop/single_turn_agent_loop.py:96``)
    and a stop token takes one of those places, so a response that ended holds fewer than
    ``max_response_length`` speech codes and one that did not holds exactly that many: unfinished
    = ``n_codes >= max_response_length``. (A response that also held other non-speech tokens would
    be judged finished: the tokenizer's text rows are never sampled by the speech head.)"""
    if max_response_length is None:
        return None
    return n_codes < max_response_length


def row_prompt_id(extra_info: dict | None) -> str | None:
    """The speaker prompt id of a verl row (``extra_info["prompt_id"]``, which stage 0 writes for a
    zero-shot row); None for a row without one (a missing key, or None: a text-only row). Anything
    else that is not a string is a ValueError (a row must not silently lose its speaker)."""
    if not isinstance(extra_info, dict):
        return None
    pid = extra_info.get(PROMPT_ID_KEY)
    if pid is None:
        return None
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise ValueError(f"extra_info[{PROMPT_ID_KEY!r}] is {pid!r} ({type(pid).__name__}), not a prompt id string")
    return str(pid)


# ---------------------------------------------------------------------------
# verl entry point

_warned_empty = False


#: the reward's terms among compute_score's keys (ttsrl.reward.rewards): --algorithm gdpo's components
TERM_KEYS = ("cer", "sim", "length")


def _result(score: float, error_rate: float, transcript: str, failed: bool, sim: float = math.nan,
            cer: float = 0.0, length: float = 0.0, finished: bool | None = None, mos: float = math.nan) -> dict:
    measured, mos_measured = math.isfinite(sim), math.isfinite(mos)
    return {"score": float(score), "error_rate": float(error_rate), "transcript": transcript,
            "reward_failed": 1.0 if failed else 0.0, "sim": float(sim) if measured else 0.0,
            "sim_measured": 1.0 if measured else 0.0,
            "mos": float(mos) if mos_measured else 0.0, "mos_measured": 1.0 if mos_measured else 0.0,
            "cer": float(cer) if math.isfinite(cer) else 0.0, "length": float(length) if math.isfinite(length) else 0.0,
            "unfinished": 1.0 if finished is False else 0.0}


async def compute_score(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict | None = None, *, config: RewardClientConfig | None = None,
                        urls: str | None = None, expect_reward: str | None = None,
                        expect_sim_weight: float | None = None, max_response_length: int | None = None,
                        expect_mos_weight: float | None = None, **kwargs) -> dict:
    """Reward of one generated response (a string of ``<|s_N|>`` tokens) for ``ground_truth``.
    ``urls`` and ``expect_reward`` come from verl's ``reward.custom_reward_function.reward_kwargs``
    (``GRPOConfig.reward_urls``/``reward``): the servers to ask, and the reward variant every
    answer must name (an answer scored by another takes its server out of rotation).
    ``expect_sim_weight``: the SIM weight of the combined reward every answer must have been scored
    with (``GRPOConfig.sim_weight``), ``expect_mos_weight`` likewise its MOS weight
    (``GRPOConfig.mos_weight``); ``max_response_length``: the rollout's response budget, which
    tells an unfinished response (:func:`is_finished`; sent as FINISHED).
    ``extra_info["prompt_id"]`` (a zero-shot row's speaker prompt): the server voices the response
    with that prompt and measures its SIM against it; rows without one are scored as before."""
    global _warned_empty
    cfg = config or RewardClientConfig.from_env(urls, expect_reward, expect_sim_weight, max_response_length,
                                                expect_mos_weight)
    prompt_id = row_prompt_id(extra_info)
    try:
        codes = parse_speech_text(solution_str or "")
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

    finished = is_finished(len(codes), cfg.max_response_length)
    window = failure_window(cfg)
    try:
        reply = await request_reward(codes, ground_truth, cfg, prompt_id, finished)
    except RequestFailed as e:
        failed = window.record(True)
        if failed > cfg.max_fail_fraction * window.size:
            hint = (f"The server refused that request as invalid (not retried): check the text {ground_truth[:80]!r}"
                    + (f" and the prompt id {prompt_id!r} (the server's --prompt-dir must hold its wav)"
                       if prompt_id is not None else "")
                    + " of the data (prepare_data.py flags texts the reward cannot read)." if e.refused else
                    f"Are the reward servers {', '.join(cfg.urls)} ({ENV_URL}) up and serving model {cfg.model!r}?")
            raise RewardServiceError(
                f"{failed} of the last {window.size} reward requests failed (limit {cfg.max_fail_fraction:.0%}, "
                f"{ENV_MAX_FAIL}; window {ENV_FAIL_WINDOW}); last error: {e}. {hint}") from e
        log.warning("reward request failed (%d of the last %d, within the %.0f%% limit); "
                    "scoring this sample 0 and flagging reward_failed: %s",
                    failed, window.size, 100 * cfg.max_fail_fraction, e)
        return _result(0.0, 1.0, "", True, finished=finished)
    window.record(False)
    return _result(reply.reward, reply.error_rate, reply.transcript, False, reply.sim, reply.cer_term,
                   reply.length_term, finished, reply.mos)


async def score_all(rows: Iterable[tuple[list[int], str]], config: RewardClientConfig | None = None) -> list[dict]:
    """Score (codes, text) pairs concurrently, like one verl step."""
    cfg = config or RewardClientConfig.from_env()
    tasks = [compute_score("cli", SpeechVocab.codes_to_text(codes), text, config=cfg) for codes, text in rows]
    return list(await asyncio.gather(*tasks))
