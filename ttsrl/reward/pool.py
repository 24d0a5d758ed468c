"""A pool of reward servers: each request goes to one, and moves to another when that one fails.

``TTSRL_REWARD_URL`` may list several base URLs (``split_urls``). Rewards depend only on the
speech codes and the text, so sending a request again to another server is always safe. Per
process (one pool per URL list, shared by every thread and event loop of the process):

* a request goes to the server in rotation with the fewest requests in flight (ties at random);
* a connection error, a timeout, a 5xx or a 200 that is unreadable or that ``accept`` refuses
  (an impossible reward, another model: ``protocol.parse_response``) takes the server out of rotation for
  a backoff (``backoff_s``, doubling with each consecutive failure, capped at ``max_backoff_s``)
  and the request goes to another server at once;
* a 503 or 429 with ``Retry-After`` (queue full, not ready yet) marks the server busy for that
  long: the request goes elsewhere and sleeps only when no server is usable;
* when its backoff has passed, a server is re-admitted once ``/v2/health/ready`` answers 200
  (the next request to pick a server probes it first);
* a 4xx other than 408/429 is the request's own fault: :class:`RequestFailed` with
  ``refused=True`` at once, never sent elsewhere;
* a request that finds no usable server waits until the first one is due and tries again, at most
  ``retries`` times; then :class:`RequestFailed` names every URL with its last error.

HTTP: one ``aiohttp`` session per event loop, opened by its first request and closed when its
last request in flight ends (so no session outlives its loop); at most ``max_connections``
requests in flight per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from ttsrl.reward.protocol import READY_PATH

log = logging.getLogger("ttsrl.reward")

PROBE_TIMEOUT_S = 2.0
PROBE_POLL_S = 0.05
BUSY_STATUS = {429, 503}  # with Retry-After: busy, not broken


class RequestFailed(Exception):
    """One reward request failed for good. ``refused``: the server answered 4xx, i.e. the request
    itself is wrong and sending it again (anywhere) gives the same answer."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    up: bool = True
    down_until: float = 0.0  # out of rotation until then, then probed
    busy_until: float = 0.0  # answered Retry-After: skipped until then
    streak: int = 0  # consecutive failures (a successful request resets it)
    probing: bool = False
    last_error: str = ""
    sent: int = 0  # attempts sent here
    ok: int = 0  # answered 200
    failed: int = 0  # attempts that failed: connection errors, timeouts, 5xx, busy (not refusals, not probes)


@dataclass
class Policy:
    """How one request moves through the pool (from ``RewardClientConfig``)."""

    timeout_s: float = 300.0
    retries: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_connections: int = 256


class EndpointPool:
    """The servers of one URL list and what this process knows about them (thread-safe)."""

    def __init__(self, urls: tuple[str, ...], clock=time.monotonic):
        if not urls:
            raise ValueError("a reward server pool needs at least one URL")
        self.endpoints = [Endpoint(u) for u in urls]
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.endpoints)

    def pick(self, exclude: set[str]) -> Endpoint | None:
        """The usable server with the fewest requests in flight; counts the request as in flight."""
        now = self._clock()
        with self._lock:
            usable = [e for e in self.endpoints if e.up and e.busy_until <= now and e.url not in exclude]
            if not usable:
                return None
            least = min(e.in_flight for e in usable)
            ep = random.choice([e for e in usable if e.in_flight == least])
            ep.in_flight += 1
            ep.sent += 1
            return ep

    def release(self, ep: Endpoint, ok: bool) -> None:
        with self._lock:
            ep.in_flight -= 1
            if ok:
                ep.ok += 1
                ep.streak = 0

    def fail(self, ep: Endpoint, error: str, policy: Policy, probe: bool = False) -> None:
        """Take ``ep`` out of rotation (a failure while already out only updates its last error)."""
        with self._lock:
            ep.failed += not probe
            ep.last_error = error
            if not ep.up and not ep.probing:
                return
            ep.streak += 1
            delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** (ep.streak - 1)) * (0.75 + random.random() / 4)
            was_up, ep.up, ep.probing = ep.up, False, False
            ep.down_until = self._clock() + delay
            left = sum(e.up for e in self.endpoints)
        if was_up:
            log.warning("reward server %s out of rotation (%s); %d of %d servers left; probing it again in %.2f s",
                        ep.url, error, left, len(self.endpoints), delay)

    def busy(self, ep: Endpoint, error: str, seconds: float) -> None:
        with self._lock:
            ep.failed += 1
            ep.last_error = error
            ep.busy_until = max(ep.busy_until, self._clock() + seconds)

    def claim_probes(self) -> list[Endpoint]:
        """Servers whose backoff has passed, each handed to one caller to probe."""
        now = self._clock()
        with self._lock:
            due = [e for e in self.endpoints if not e.up and not e.probing and e.down_until <= now]
            for e in due:
                e.probing = True
            return due

    def admit(self, ep: Endpoint) -> None:
        with self._lock:
            ep.up, ep.probing, ep.busy_until = True, False, 0.0
            left = sum(e.up for e in self.endpoints)
        log.warning("reward server %s is ready again: back in rotation (%d of %d servers)", ep.url, left,
                    len(self.endpoints))

    def next_usable_in(self) -> float | None:
        """Seconds until some server may be usable again (0 if one is usable now); None while a
        server is being probed (its caller will know soon)."""
        now = self._clock()
        with self._lock:
            if any(e.probing for e in self.endpoints):
                return None
            return max(0.0, min(e.down_until if not e.up else e.busy_until for e in self.endpoints) - now)

    def describe(self) -> str:
        with self._lock:
            return "; ".join(f"{e.url}: {e.last_error or 'no error recorded'}" for e in self.endpoints)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per URL: attempts ``sent``, answered ``ok``, ``failed``; and ``in_flight``, ``up``."""
        with self._lock:
            return {e.url: {"sent": e.sent, "ok": e.ok, "failed": e.failed, "in_flight": e.in_flight,
                            "up": int(e.up)} for e in self.endpoints}

    # -----------------------------------------------------------------------

    async def post(self, path: str, payload: dict, policy: Policy, accept: Callable[[dict], Any] = lambda a: a) -> Any:
        """POST ``payload`` to ``path`` of some server; ``accept`` of its JSON answer (see the module
        doc). ``accept`` raises ``ValueError`` for an answer that must not be used: the server that
        gave it is out of rotation (it was answering, so it would keep answering so) and the
        request goes to another."""
        async with _loop_session(policy.max_connections) as session:
            tried: set[str] = set()
            waits = 0
            while True:
                for ep in self.claim_probes():
                    await self._probe(session, ep, policy)
                ep = self.pick(tried)
                if ep is None:
                    delay = self.next_usable_in()
                    if delay is None:  # another request is probing a server: wait for its answer
                        await asyncio.sleep(PROBE_POLL_S)
                        continue
                    if waits >= policy.retries:
                        raise RequestFailed(f"no reward server could answer (after {waits} waits for one): "
                                            f"{self.describe()}")
                    waits += 1
                    tried.clear()
                    await asyncio.sleep(delay + 0.001)
                    continue
                tried.add(ep.url)
                ok = False
                try:
                    answer = await self._attempt(session, ep, path, payload, policy, accept)
                    ok = answer is not None
                finally:
                    self.release(ep, ok)
                if ok:
                    return answer

    async def _attempt(self, session, ep: Endpoint, path: str, payload: dict, policy: Policy,
                       accept: Callable[[dict], Any]) -> Any:
        """One attempt at ``ep``: ``accept`` of its JSON, or None after marking ``ep`` failed or busy."""
        url = ep.url + path
        try:
            async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=policy.timeout_s)) as resp:
                if resp.status == 200:
                    answer = await resp.json(content_type=None)
                    if not isinstance(answer, dict):
                        raise ValueError(f"the answer is not a JSON object: {str(answer)[:100]}")
                    try:
                        return accept(answer)
                    except ValueError as e:  # answered, but nothing to use: out of rotation
                        raise ValueError(f"invalid answer: {e}") from None
                detail = (await resp.text())[:300]
                error = f"HTTP {resp.status} from {url}: {detail}"
                if 400 <= resp.status < 500 and resp.status not in (408, 429):
                    raise RequestFailed(error, refused=True)
                retry_after = _seconds(resp.headers.get("Retry-After"))
                if resp.status in BUSY_STATUS and (retry_after is not None or resp.status == 429):
                    self.busy(ep, error, policy.backoff_s if retry_after is None else retry_after)
                    return None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            error = f"{type(e).__name__} talking to {url}" + (f": {e}" if str(e) else "")
        self.fail(ep, error, policy)
        return None

    async def _probe(self, session, ep: Endpoint, policy: Policy) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=min(PROBE_TIMEOUT_S, policy.timeout_s))
            async with session.get(ep.url + READY_PATH, timeout=timeout) as resp:
                if resp.status == 200:
                    self.admit(ep)
                    return
                error = f"not ready: {READY_PATH} answered HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            error = f"{type(e).__name__} probing {ep.url}{READY_PATH}" + (f": {e}" if str(e) else "")
        except BaseException:
            self.fail(ep, "probe interrupted", policy, probe=True)  # out of rotation, claimable again
            raise
        self.fail(ep, error, policy, probe=True)


def _seconds(header: str | None) -> float | None:
    try:
        value = float(header) if header else None
    except ValueError:
        return None
    return min(value, 60.0) if value is not None and value >= 0 else None


_POOLS: dict[tuple[str, ...], EndpointPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(urls: tuple[str, ...]) -> EndpointPool:
    """This process's pool for ``urls`` (one per URL list, so its knowledge is shared by all calls)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(urls)
        if pool is None:
            pool = _POOLS[urls] = EndpointPool(urls)
        return pool


# ---------------------------------------------------------------------------
# one HTTP session per event loop


class _LoopHTTP:
    def __init__(self, max_connections: int):
        self.semaphore = asyncio.Semaphore(max_connections)
        self.session: aiohttp.ClientSession | None = None
        self.users = 0


_LOOPS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopHTTP]" = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def _loop_session(max_connections: int):
    loop = asyncio.get_running_loop()
    state = _LOOPS.get(loop)
    if state is None:
        state = _LOOPS[loop] = _LoopHTTP(max_connections)
    async with state.semaphore:
        if state.session is None:
            state.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections))
        state.users += 1
        try:
            yield state.session
        finally:
            state.users -= 1
            if state.users == 0:
                session, state.session = state.session, None
                await session.close()
