"""Stand-ins for running a worker loop or role in the test process (``tests/`` is on sys.path: conftest)."""
from __future__ import annotations

import os


class Outbox:
    """Stands in for the worker's pipe: records what is sent; ``fileno`` is a real (silent) pipe for the
    loop's inbox poll."""

    def __init__(self):
        self.sent = []
        self._fds = os.pipe()

    def fileno(self) -> int:
        return self._fds[0]

    def send(self, msg) -> None:
        self.sent.append(msg)

    def of_type(self, kind) -> list:
        return [m for m in self.sent if isinstance(m, kind)]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
