"""A real ``homepd serve`` process for the service tests (this module holds the harness, no test).

The server runs as ``python -m homepd serve`` in its own session, on a free
loopback port, logging to a file; tests wait on its ``/ready`` (never on a
sleep) and stop it with SIGTERM, checking its exit status.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from homepd.osutil import die_with_parent

READY_TIMEOUT_S = 120.0  # a cold start on a loaded 2-core box: imports, model load, warm-up
API_KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None, api_key: str | None = API_KEY,
                 wrapper: tuple[str, ...] = ()):
        """``wrapper``: a command the server runs under (e.g. ``prlimit --nofile=256``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = tmp_path / f"serve-{self.port}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("HOMEPD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        clean["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")  # no user config file leaks in
        clean["HOMEPD_DB"] = str(tmp_path / "homepd.db")  # the traffic recording stays in the test's directory
        if api_key:
            clean["HOMEPD_API_KEY"] = api_key
        clean.update(env or {})
        self.argv = [*wrapper, sys.executable, "-m", "homepd", "serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, env=clean, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)  # why: an interrupted pytest leaves no server

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60.0), **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "ServeProcess":
        deadline = time.monotonic() + timeout_s
        with self.client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise AssertionError(f"homepd serve exited ({self.process.returncode}):\n{self.log()}")
                try:
                    if client.get("/ready").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)  # polling /ready: the readiness signal itself
        raise AssertionError(f"homepd serve not ready after {timeout_s} s:\n{self.log()}")

    def wait_until(self, predicate, timeout_s: float = 30.0, what: str = "condition"):
        """Poll GET /status until ``predicate(status)`` holds; return that status."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                status = client.get("/status").json()
                if predicate(status):
                    return status
                time.sleep(0.02)
        raise AssertionError(f"{what} not reached in {timeout_s} s; last status: {status}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed and failed if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"homepd serve did not exit {timeout_s} s after SIGTERM:\n{self.log()}")
        finally:
            self._log.close()

    def worker_pids(self) -> list[int]:
        with self.client() as client:
            return [w["pid"] for w in client.get("/status").json()["engine"]["workers"]]
