"""Connection hygiene for the reward server: read timeouts, a connection cap, and a
log that says a repeated error once with a count.

aiohttp's server has no timeout for a request's headers (a client may send half a
request line and wait forever) and no cap on open connections, so 1,100 idle partial
requests under ``ulimit -n 1024`` exhausted the file descriptors: every valid
request then blocked and asyncio logged "Too many open files" hundreds of thousands
of times. :class:`ConnectionGuard` wraps aiohttp's protocol factory:

* a connection that is not inside a request handler (headers still arriving, or idle
  between keep-alive requests) for ``idle_timeout_s`` is closed;
* at most ``max_connections`` are open; a new one beyond that evicts the connection
  idle the longest (one opened less than ``MIN_READ_S`` ago only when no slow body is
  there to take instead), else the slowest body reader: of the requests whose body has been
  arriving for at least ``MIN_READ_S``, the one receiving the fewest bytes a second (so
  1,024 connections trickling 4 bytes of a declared 100 kB body cannot lock valid clients
  out for the body timeout); a request being scored is never evicted, and a new connection
  is closed at once only when every one is being scored or has just begun its body.

The body read timeout is the handler's (``asyncio.wait_for`` around the read); the handler
says when it starts and ends reading a body (``reading``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable


def default_max_connections() -> int:
    """Half the process's file-descriptor limit (the rest: models, logs, the backlog), at most 1024."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(8, min(1024, soft // 2))


MIN_READ_S = 0.25  # a body younger than this is never taken for a slow one


class _Conn:
    __slots__ = ("transport", "busy", "idle_since", "received", "reading_since", "read_from")

    def __init__(self, transport):
        self.transport = transport
        self.busy = 0
        self.idle_since = time.monotonic()
        self.received = 0  # bytes received on this connection
        self.reading_since: float | None = None  # when the handler began waiting for the body
        self.read_from = 0  # ``received`` then

    def read_rate(self, now: float) -> float:
        return (self.received - self.read_from) / max(now - (self.reading_since or now), 1e-9)


class _GuardedProtocol(asyncio.Protocol):
    """Delegates to aiohttp's RequestHandler; tells the guard when it opens and closes."""

    def __init__(self, inner: asyncio.Protocol, guard: "ConnectionGuard"):
        self._inner = inner
        self._guard = guard
        self._transport = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._inner.connection_made(transport)
        self._guard._opened(transport)

    def connection_lost(self, exc) -> None:
        self._guard._closed(self._transport)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._guard._received(self._transport, len(data))
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ConnectionGuard:
    """Protocol factory around aiohttp's ``web.Server`` (see the module doc)."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], max_connections: int, idle_timeout_s: float):
        self.factory = factory
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.conns: dict[Any, _Conn] = {}
        self.evicted = 0  # idle connections closed to make room
        self.evicted_slow = 0  # slow body readers closed to make room
        self.refused = 0  # new connections closed because all were busy
        self.timed_out = 0  # idle connections closed after idle_timeout_s
        self._sweeper: asyncio.Task | None = None

    def __call__(self) -> asyncio.Protocol:
        return _GuardedProtocol(self.factory(), self)

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    # ---- handler side -----------------------------------------------------------
    def enter(self, transport) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.busy += 1

    def leave(self, transport) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.busy = max(0, c.busy - 1)
            c.idle_since = time.monotonic()
            c.reading_since = None

    def reading(self, transport, started: bool) -> None:
        """The handler on ``transport`` begins (True) or ends (False) waiting for a request body."""
        c = self.conns.get(transport)
        if c is not None:
            c.reading_since, c.read_from = (time.monotonic(), c.received) if started else (None, 0)

    # ---- protocol side ----------------------------------------------------------
    def _opened(self, transport) -> None:
        if len(self.conns) >= self.max_connections:
            now = time.monotonic()
            idle = [c for c in self.conns.values() if not c.busy]
            stale = [c for c in idle if now - c.idle_since >= MIN_READ_S]
            slow = [c for c in self.conns.values()
                    if c.busy and c.reading_since is not None and now - c.reading_since >= MIN_READ_S]
            if stale or (idle and not slow):  # a connection just opened is not taken while a slow body is there
                victim = min(stale or idle, key=lambda c: c.idle_since)
                self.evicted += 1
            elif slow:
                victim = min(slow, key=lambda c: (c.read_rate(now), c.reading_since))
                self.evicted_slow += 1
            else:
                self.refused += 1
                transport.abort()
                return
            self.conns.pop(victim.transport, None)
            victim.transport.abort()
        self.conns[transport] = _Conn(transport)

    def _received(self, transport, n: int) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.received += n

    def _closed(self, transport) -> None:
        self.conns.pop(transport, None)

    async def _sweep(self) -> None:
        period = max(0.05, min(1.0, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.idle_timeout_s
            for c in [c for c in self.conns.values() if not c.busy and c.idle_since < deadline]:
                self.conns.pop(c.transport, None)
                c.transport.abort()
                self.timed_out += 1

    def as_dict(self) -> dict:
        return {"open_connections": len(self.conns), "max_connections": self.max_connections,
                "connections_evicted": self.evicted, "connections_evicted_slow_body": self.evicted_slow,
                "connections_refused": self.refused,
                "connections_timed_out": self.timed_out}


class RepeatedErrors:
    """Log an error in full the first time, then only count it; ``flush`` logs the
    counts (called every ``interval_s`` by the server and at shutdown)."""

    def __init__(self, log: logging.Logger, interval_s: float = 60.0):
        self.log = log
        self.interval_s = interval_s
        self._seen: set[str] = set()
        self._pending: dict[str, int] = {}

    def error(self, key: str, msg: str, *args, exc_info=None) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.log.error(msg, *args, exc_info=exc_info)
        else:
            self._pending[key] = self._pending.get(key, 0) + 1

    def flush(self) -> None:
        for key, n in self._pending.items():
            self.log.error("%s (repeated %d more time%s, logged once above)", key, n, "" if n == 1 else "s")
        self._pending.clear()

    def loop_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """An asyncio exception handler (``loop.set_exception_handler``) that dedups."""
        exc = context.get("exception")
        key = f"asyncio: {context.get('message', '')}: {type(exc).__name__ if exc else ''}: {exc}"
        self.error(key, "%s", key, exc_info=exc)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.flush()
