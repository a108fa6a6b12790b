"""Bounds on connections, so that idle, slow or stalled sockets cannot lock the service out.

uvicorn has a keep-alive timeout but no deadline for reading a request, and it
accepts sockets until the process runs out of file descriptors (then asyncio
logs every failed ``accept``).  Here each connection is in one ``Phase`` at a
time, with the deadline of that phase: ``header_timeout_s`` to send a request's
headers (from opening, or from its last response), then ``body_timeout_s`` to
send its body (a 408, and the connection closed).  ``ConnectionGuard`` keeps
the connections under a cap below the descriptor limit; at the cap it closes
the connection that has been sending its request the longest, so that a
complete request always gets in, and refuses a new one only when every open
connection is being served.  The cap follows the limit: it is re-read once a
second and whenever ``accept`` runs out of descriptors, so that a limit
lowered on the running service (``prlimit --pid``) sheds slow connections
instead of stopping ``accept``.  ``RateLimitedLog`` keeps a storm of identical
errors to one line per period, with the count it held back.
"""
from __future__ import annotations

import enum
import errno
import json
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from homepd.serve.errors import APIError

log = logging.getLogger("homepd.serve")
FDS_RESERVED = 128          # descriptors kept for the engine: worker pipes, model files, /dev/shm, logs
LOG_PERIOD_S = 10.0


def soft_fd_limit() -> int:
    """The descriptor limit in force (the soft RLIMIT_NOFILE)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


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


class Phase(enum.Enum):
    """Where a connection is in its current request."""
    HEADERS = "headers"  # sending a request's headers: just opened, or idle after a response
    BODY = "body"        # its headers are in, its body is still arriving
    SERVING = "serving"  # the whole request is in: the app answers it

    @property
    def is_slow(self) -> bool:
        """Still sending its request: it may be closed to make room."""
        return self is not Phase.SERVING


CLOSED_FOR_ROOM = ("the service is at its connection cap, and this request had been arriving the longest: its "
                   "connection was closed to make room; send the body at once after the headers")


class ConnectionGuard:
    """The open connections of one server, the cap on them, and those still sending a request, the one sending
    the longest first.  A connection is any object with ``close_slow(why)``, which closes it."""

    def __init__(self, max_connections: int, read_fd_limit: Callable[[], int] = soft_fd_limit):
        self.max_connections, self._read_fd_limit = max_connections, read_fd_limit
        self.fd_limit = read_fd_limit()
        self.cap = connection_limit(max_connections, self.fd_limit)
        self._open: set = set()
        self._slow: OrderedDict = OrderedDict()  # in the order they began sending their request
        self.n_closed_slow = self.n_refused = 0

    @property
    def n_open(self) -> int:
        return len(self._open)

    @property
    def n_slow(self) -> int:
        return len(self._slow)

    def admit(self, conn) -> bool:
        """Count a new connection in (it is sending its request); at the cap, close the connection that has
        been sending its own the longest to make room.  False if none is: ``conn`` must be closed."""
        if len(self._open) >= self.cap:
            self._make_room(len(self._open) - self.cap + 1)
        if len(self._open) >= self.cap:
            self.n_refused += 1
            return False
        self._open.add(conn)
        self._slow[conn] = None
        return True

    def moved(self, conn, phase: Phase) -> None:
        """``conn`` is in ``phase`` now: still slow, it keeps its place; slow again, it goes last."""
        if conn not in self._open:
            return
        if not phase.is_slow:
            self._slow.pop(conn, None)
        elif conn not in self._slow:
            self._slow[conn] = None

    def closed(self, conn) -> None:
        self._open.discard(conn)
        self._slow.pop(conn, None)

    def follow_fd_limit(self) -> int:
        """Re-read the descriptor limit, set the cap from it and close the slow connections above it; the cap."""
        fd_limit = self._read_fd_limit()
        if fd_limit != self.fd_limit:
            log.warning("homepd: the file-descriptor limit is now %d (it was %d): at most %d connections",
                        fd_limit, self.fd_limit, connection_limit(self.max_connections, fd_limit))
        self.fd_limit, self.cap = fd_limit, connection_limit(self.max_connections, fd_limit)
        if len(self._open) > self.cap:
            self._make_room(len(self._open) - self.cap)
        return self.cap

    def _make_room(self, n: int) -> None:
        """Close up to ``n`` slow connections, those sending their request the longest first."""
        n = min(n, len(self._slow))
        if n:
            _made_room.note(f"homepd: at the connection cap ({self.cap}: --max-connections, or the descriptor limit "
                            f"{self.fd_limit} less {FDS_RESERVED}); closing the connections that have been "
                            "sending their request the longest")
        for _ in range(n):
            conn, _ = self._slow.popitem(last=False)
            self._open.discard(conn)
            self.n_closed_slow += 1
            conn.close_slow(CLOSED_FOR_ROOM)


def follow_fd_limit_on_accept_errors(loop, guard: ConnectionGuard) -> None:
    """When ``accept`` runs out of descriptors, re-read the limit at once (the server's tick does it once a
    second); the error is then handled as before."""
    previous = loop.get_exception_handler()

    def handler(loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            guard.follow_fd_limit()
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def guarded_protocol(guard: ConnectionGuard, header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline per ``Phase`` and ``guard``'s connection cap."""
    deadline_s = {Phase.HEADERS: header_timeout_s, Phase.BODY: body_timeout_s}
    body_late = (f"the request body did not arrive within {body_timeout_s:g} s of its headers (--body-timeout); "
                 "send it whole, at once after the headers")

    class GuardedH11Protocol(H11Protocol):
        phase: Phase | None = None  # None: refused at the cap
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if not guard.admit(self):
                # why: close now rather than hold a descriptor we cannot serve; the client sees a reset
                _refused.note(f"homepd: {guard.cap} connections open (--max-connections, or the descriptor limit "
                              f"less {FDS_RESERVED}), each being served; closing new ones until some end")
                transport.close()
                return
            self._enter(Phase.HEADERS)

        def handle_events(self) -> None:
            super().handle_events()
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def connection_lost(self, exc) -> None:
            self._cancel_deadline()
            guard.closed(self)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Enter the phase h11 says the request is in, if it changed."""
            if self.phase is None or self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:
                phase = Phase.HEADERS
            else:
                phase = Phase.BODY if self.conn.their_state is h11.SEND_BODY else Phase.SERVING
            if phase is not self.phase:
                self._enter(phase)

        def _enter(self, phase: Phase) -> None:
            self.phase = phase
            guard.moved(self, phase)
            self._cancel_deadline()
            if phase in deadline_s:
                self._deadline = self.loop.call_later(deadline_s[phase], self._deadline_passed)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _deadline_passed(self) -> None:
            self._deadline = None
            guard.closed(self)
            self.close_slow(body_late)

        def close_slow(self, why: str) -> None:
            """Close this connection, which is still sending its request; answer 408 saying ``why`` where its
            headers are in and no response has started."""
            self._cancel_deadline()
            if self.transport.is_closing():
                return
            if self.phase is Phase.BODY and not self.cycle.response_started:
                self._send_408(why)
            self.transport.close()

        def _send_408(self, message: str) -> None:
            body = json.dumps(APIError(408, message, code="request_timeout").body()).encode()
            # why: the app still waits for the body; from now on what it sends is dropped, not a second answer
            self.cycle.disconnected = True
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 holds it cannot answer now: closing is all that is left
                pass

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
_made_room = _Notice()


def install_log_limits(period_s: float = LOG_PERIOD_S) -> None:
    """Rate-limit what asyncio and uvicorn log per connection (accept errors, protocol errors)."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(RateLimitedLog(period_s))
