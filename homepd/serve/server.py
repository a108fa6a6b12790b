"""Run the service under uvicorn until SIGTERM (or Ctrl-C) has drained it; return the exit status.

The first SIGTERM/SIGINT starts the drain (new requests get 503, running ones
finish for ``--drain-timeout`` seconds, the rest are aborted), then uvicorn
exits and the engine stops: exit 0.  A second signal aborts the running
requests at once (still a clean stop), a third exits without cleaning up.  uvicorn's
own handler would stop accepting connections at the first signal and re-raise
it on the way out (exit status -15), so ``handle_exit`` is replaced.
"""
from __future__ import annotations

import logging
import signal

import uvicorn

from homepd.serve.app import create_app
from homepd.serve.connections import connection_limit, guarded_protocol, install_log_limits, raise_fd_limit

GRACEFUL_SHUTDOWN_S = 10.0  # after the drain: how long uvicorn waits for connections to close


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service):
        super().__init__(config)
        self.service = service
        self.n_signals = 0

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
    max_connections = connection_limit(settings.max_connections, raise_fd_limit())
    install_log_limits()
    config = uvicorn.Config(create_app(service), host=settings.host, port=settings.port, log_level="info",
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            lifespan="on", server_header=False,
                            http=guarded_protocol(settings.header_timeout_s, max_connections))
    server = DrainingServer(config, service)
    service.on_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    return service.exit_code
