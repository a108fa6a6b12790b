"""Run the service under uvicorn until SIGTERM (or Ctrl-C) has drained it; return the exit status.

The first SIGTERM/SIGINT starts the drain (new requests get 503, running ones
finish for ``--drain-timeout`` seconds, the rest are aborted), then uvicorn
exits and the engine stops: exit 0.  A second signal aborts the running
requests at once (still a clean stop), a third exits without cleaning up.  uvicorn's
own handler would stop accepting connections at the first signal and re-raise
it on the way out (exit status -15), so ``handle_exit`` is replaced.  Once a
second (uvicorn's tick) and whenever ``accept`` runs out of descriptors, the
connection cap is set again from the descriptor limit.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from homepd.serve.app import create_app
from homepd.serve.connections import (ConnectionGuard, follow_fd_limit_on_accept_errors, guarded_protocol,
                                      install_log_limits, raise_fd_limit)

GRACEFUL_SHUTDOWN_S = 10.0  # after the drain: how long uvicorn waits for connections to close
TICKS_PER_S = 10  # uvicorn's main loop ticks every 0.1 s


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service, guard: ConnectionGuard):
        super().__init__(config)
        self.service, self.guard = service, guard
        self.n_signals = 0

    async def startup(self, sockets=None) -> None:
        follow_fd_limit_on_accept_errors(asyncio.get_running_loop(), self.guard)
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if counter % TICKS_PER_S == 0:
            self.guard.follow_fd_limit()  # why: `prlimit --pid` may have lowered it since
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        """1st signal: drain; 2nd: abort what runs and stop cleanly; 3rd: exit at once."""
        self.n_signals += 1
        loop = getattr(self.service, "loop", None)
        if loop is None or self.n_signals > 2:  # before the app started, or asked three times
            self.force_exit = self.n_signals > 2
            self.should_exit = True
            return
        logging.getLogger("homepd.serve").info("homepd: %s received", signal.Signals(sig).name)
        timeout_s = None if self.n_signals == 1 else 0.0
        loop.call_soon_threadsafe(lambda: loop.create_task(self.service.drain(timeout_s)))


def run_server(service) -> int:
    """Serve until drained or failed; the process exit status (0 after a drain, 1 if the engine failed)."""
    settings = service.settings
    raise_fd_limit()
    guard = ConnectionGuard(settings.max_connections)
    install_log_limits()
    config = uvicorn.Config(create_app(service), host=settings.host, port=settings.port, log_level="info",
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            lifespan="on", server_header=False,
                            http=guarded_protocol(guard, settings.header_timeout_s, settings.body_timeout_s))
    server = DrainingServer(config, service, guard)
    service.on_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    return service.exit_code
