"""Controller-side handle on one worker process: spawn, send, read, stop.

The asyncio loop watches the pipe (``add_reader``) and handles every message
as it arrives; when the pipe closes (the worker exited or was killed) the exit
is reported at once.  Each (re)start is a new generation: late messages from an
older process are dropped.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from homepd.core.records import WorkerSnapshot
from homepd.errors import WorkerError
from homepd.osutil import single_thread_blas
from homepd.core.protocol import Shutdown, WorkerReady, wire_fingerprint

STOP_TIMEOUT_S = 5.0
log = logging.getLogger("homepd.engine.handles")


def spawn_worker(spec, module: str = "homepd.worker") -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m <module>`` (a worker, or the bench's reference loop) on one end of a socketpair and
    send it its spec.

    # why: a fresh interpreter (the spawn start method's effect) without
    # multiprocessing re-importing the caller's __main__, so any caller (a
    # script, the TUI, a notebook) can start workers.
    """
    parent_sock, child_sock = socket.socketpair()
    env = single_thread_blas(dict(os.environ))
    env["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices  # "" hides every GPU from a CPU worker
    try:
        process = subprocess.Popen([sys.executable, "-m", module, str(child_sock.fileno())],
                                   pass_fds=[child_sock.fileno()], env=env, stdin=subprocess.DEVNULL)
    finally:
        child_sock.close()
    conn = Connection(parent_sock.detach())
    conn.send(spec)
    return process, conn


class WorkerHandle:
    def __init__(self, role: str, spec, loop: asyncio.AbstractEventLoop, on_message, on_exit):
        self.role, self.spec, self.loop = role, spec, loop
        self._on_message, self._on_exit = on_message, on_exit
        self.process = None
        self.conn = None
        self.generation = 0
        self.ready: WorkerReady | None = None
        self.last_load_s: float | None = None   # spawn -> ready of its latest start (what a restart should take)
        self._started_s = time.monotonic()
        self.ready_s: float | None = None      # when its latest WorkerReady arrived (a restart's true end)
        self._ready_future: asyncio.Future | None = None
        self._send_lock = threading.Lock()
        self.in_flight: set[str] = set()
        self.backlog: deque = deque()  # (request_id, message) held while (re)starting
        self.restarts = -1
        self.last_error: str | None = None
        self.failed: str | None = None  # set when it could not be (re)started: no more work for it
        self.deaths: deque[float] = deque(maxlen=16)  # monotonic times of its deaths (crash-loop detection)
        self.last_heard_s = time.monotonic()  # when its pipe last had something (hang detection)
        self.stopping = False
        self.cache_stats = None  # PrefixCacheStats: the latest its steps reported (None: no prefix cache)
        self.kv_range = 0  # the KV cells its latest step attended over (``StepRecord.kv_in_use``: its cache's range)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def start(self) -> None:
        """Spawn the process and wait until its model is loaded."""
        self.generation += 1
        self.restarts += 1
        self.ready = None
        self._ready_future = self.loop.create_future()
        self._started_s = time.monotonic()
        process, parent_conn = await asyncio.to_thread(spawn_worker, self.spec)
        self.process, self.conn = process, parent_conn
        if self.stopping:  # stopped while it was being spawned: do not leave it behind
            process.kill()
            await asyncio.to_thread(process.wait)
            raise WorkerError(f"{self.role} worker start cancelled: the engine is stopping")
        # why: reading on the loop itself (no reader thread) costs no thread
        # wake-up or GIL hand-off per token, which on a 2-core box is CPU taken
        # straight from llama.cpp's threads.
        self.loop.add_reader(parent_conn.fileno(), self._readable, parent_conn, process, self.generation)
        await self._ready_future

    def _readable(self, conn, process, generation: int) -> None:
        self.last_heard_s = time.monotonic()
        try:
            # one message per callback: the loop calls again while data is pending
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        except Exception as exc:  # an unpicklable message: treat as a dead worker
            self.last_error = f"bad message from worker: {exc}"
            process.kill()
            msg = None
        if msg is not None:
            try:
                self._deliver(generation, msg)
            except Exception:  # a controller bug must not kill a healthy worker
                log.exception("homepd: error handling %s from the %s worker", type(msg).__name__, self.role)
            return
        self.loop.remove_reader(conn.fileno())
        self._reaper = asyncio.ensure_future(self._reap(process, generation))  # referenced until done

    async def _reap(self, process, generation: int) -> None:
        try:
            exitcode = await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # pipe closed but still running: finish it off
            process.kill()
            exitcode = await asyncio.to_thread(process.wait)
        self._exited(generation, exitcode)

    def _deliver(self, generation: int, msg) -> None:
        if generation != self.generation:
            return
        if isinstance(msg, WorkerReady) and msg.wire != wire_fingerprint():
            # why: a worker whose code is not ours (the package changed under us) must not be sent work
            self.last_error = f"version mismatch: the worker's homepd code (wire {msg.wire or 'unknown'}) is not " \
                              f"the controller's (wire {wire_fingerprint()}); restart the service to run the new version"
            self.process.kill()
            return
        if isinstance(msg, WorkerReady):
            self.ready = msg
            self.ready_s = time.monotonic()
            self.last_load_s = self.ready_s - self._started_s
            while self.backlog:
                _, queued = self.backlog.popleft()
                self.send(queued)
            if not self._ready_future.done():
                self.failed = None
                self._ready_future.set_result(msg)
        self._on_message(self, msg)

    def _exited(self, generation: int, exitcode: int | None) -> None:
        if generation != self.generation:
            return
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(WorkerError(
                f"{self.role} worker failed to start (exit code {exitcode}): {self.last_error or 'no message'}"))
            return
        self.ready = None  # requests sent from now on wait in the backlog for the restart
        if not self.stopping:
            self._on_exit(self, exitcode)

    async def restart(self, attempts: int, backoff_s: float) -> Exception | None:
        """Start it again, up to ``attempts`` times with doubling waits; the last error if it never came back."""
        error = None
        for attempt in range(attempts):
            try:
                await self.start()
                return None
            except Exception as exc:
                error = exc
                await asyncio.sleep(backoff_s * 2 ** attempt)
        return error

    def is_hung(self, now_s: float, timeout_s: float) -> bool:
        """Ready, holding requests, and silent for ``timeout_s``: a step that never ends."""
        return self.ready is not None and bool(self.in_flight) and now_s - self.last_heard_s > timeout_s

    def kill_hung(self, silent_s: float) -> None:
        """Kill a hung worker; the closing pipe then takes the usual death path (restart, resume)."""
        self.last_error = f"no message for {silent_s:.0f} s while holding requests (hung); killed"
        self.process.kill()

    def send_request(self, request_id: str, msg) -> None:
        if not self.in_flight:
            self.last_heard_s = time.monotonic()  # the hang clock starts with its first work
        self.in_flight.add(request_id)
        if self.ready is None:
            self.backlog.append((request_id, msg))
        else:
            self.send(msg)

    def drop_backlog(self, request_id: str) -> bool:
        for item in list(self.backlog):
            if item[0] == request_id:
                self.backlog.remove(item)
                return True
        return False

    def send(self, msg) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # the pipe's reader on the loop (_readable) sees it close and reaps the worker

    async def stop(self) -> None:
        self.stopping = True
        if self.process is None:
            return
        self.send(Shutdown())
        if self.conn is not None and not self.conn.closed:
            try:
                self.loop.remove_reader(self.conn.fileno())
            except (ValueError, OSError):
                pass
        try:
            await asyncio.to_thread(self.process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        self.conn.close()

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(
            role=self.role, pid=self.pid, alive=self.is_alive, ready=self.ready is not None,
            restarts=max(self.restarts, 0), n_threads=self.spec.n_threads,
            cpu_cores=tuple(self.spec.cpu_cores) if self.spec.cpu_cores else None,
            cuda_visible_devices=self.spec.cuda_visible_devices, n_gpu_layers=self.spec.n_gpu_layers,
            in_flight=tuple(sorted(self.in_flight)), backlog=len(self.backlog), failed=self.failed,
            flash_attn=self.spec.flash_attn)


async def watch_for_hangs(handles: dict[str, WorkerHandle], timeout_s: float, is_stopping) -> None:
    """Every second: kill a worker that holds requests but has said nothing for ``timeout_s``."""
    while not is_stopping():
        await asyncio.sleep(min(1.0, timeout_s / 4))
        now = time.monotonic()
        for handle in handles.values():
            if handle.is_hung(now, timeout_s):
                handle.kill_hung(now - handle.last_heard_s)
