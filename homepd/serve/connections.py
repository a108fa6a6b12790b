"""Bounds on connections, so that idle or slow sockets cannot take the service down.

uvicorn has a keep-alive timeout but none for reading a request's headers,
and it accepts sockets until the process runs out of file descriptors (then
asyncio logs every failed ``accept``).  ``guarded_protocol`` closes a
connection whose headers are not complete ``header_timeout_s`` after it opened
(or after its last response), and closes new connections at once beyond
``max_connections``; ``connection_limit`` keeps that below the descriptor
limit; ``RateLimitedLog`` keeps a storm of identical errors to one line per
period, with the count it held back.
"""
from __future__ import annotations

import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("homepd.serve")
FDS_RESERVED = 128          # descriptors kept for the engine: worker pipes, model files, /dev/shm, logs
LOG_PERIOD_S = 10.0


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_limit(max_connections: int, fd_limit: int) -> int:
    """The connections to keep open at most: the setting, but at least ``FDS_RESERVED`` below ``fd_limit``."""
    return max(1, min(max_connections, fd_limit - FDS_RESERVED))


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header-read deadline and a connection cap."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_deadline = None
            if len(self.connections) > max_connections:
                # why: close now rather than hold a descriptor we cannot serve; the client sees a reset
                _refused.note(f"homepd: more than {max_connections} connections open (--max-connections); "
                              "closing new ones until some end")
                transport.close()
                return
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_deadline(self) -> None:
            if getattr(self, "_header_deadline", None) is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_timeout(self) -> None:
            self._header_deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request under way: idle or slow headers
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_deadline()  # its headers are in: the app and the keep-alive timer take over

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

    return GuardedH11Protocol


class RateLimitedLog(logging.Filter):
    """A logging filter that lets through one record per (logger, message) per ``period_s``; the next one it
    lets through says how many it held back."""

    def __init__(self, period_s: float = LOG_PERIOD_S):
        super().__init__()
        self.period_s = period_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        last_s, n_held = self._last.get(key, (-self.period_s, 0))
        if now - last_s < self.period_s:
            self._last[key] = (last_s, n_held + 1)
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = (now, 0)
        if n_held:
            record.msg = f"{record.msg} [and {n_held} more like it in the last {now - last_s:.0f} s]"
        return True


class _Notice:
    """A warning logged at most once per period."""

    def __init__(self, period_s: float = LOG_PERIOD_S):
        self.period_s, self._last_s, self._n = period_s, -period_s, 0

    def note(self, message: str) -> None:
        self._n += 1
        now = time.monotonic()
        if now - self._last_s >= self.period_s:
            log.warning("%s (%d times)", message, self._n)
            self._last_s, self._n = now, 0


_refused = _Notice()


def install_log_limits(period_s: float = LOG_PERIOD_S) -> None:
    """Rate-limit what asyncio and uvicorn log per connection (accept errors, protocol errors)."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(RateLimitedLog(period_s))
