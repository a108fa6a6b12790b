"""Talking to systemd when it started us (``Type=notify``): READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

Without ``$NOTIFY_SOCKET`` (a foreground run, a test) every call is a no-op.
The watchdog interval is half of ``$WATCHDOG_USEC`` (the unit's
``WatchdogSec=``), as sd_watchdog_enabled(3) recommends.
"""
from __future__ import annotations

import os

import sdnotify


class Notifier:
    def __init__(self):
        env = os.environ  # sdnotify reads $NOTIFY_SOCKET from here too
        self.is_enabled = bool(env.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.is_enabled else None
        if self._notifier is not None and self._notifier.socket is not None:
            # why: a notification must never block the event loop; one that does not fit is dropped
            self._notifier.socket.setblocking(False)
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        is_ours = pid is None or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 2e6 if usec and usec.isdigit() and int(usec) > 0 and is_ours else None

    def notify(self, *lines: str) -> None:
        if self._notifier is not None:
            self._notifier.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")
