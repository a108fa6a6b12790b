"""The worker processes of one engine, as a set: started and stopped together, registered with the
hardware sampler, restarted in the background, watched for hangs, measured; the KV store tier's segments
they attach; and the engine's background tasks.  What a worker's messages and death mean for the requests
is the controller's."""
from __future__ import annotations

import asyncio
import logging
import os
import time

from homepd.core.records import MemoryBreakdown
from homepd.engine.handles import WorkerHandle
from homepd.hw.smaps import ProcessRegions, measure_processes
from homepd.kv.store import StoreBook

log = logging.getLogger("homepd.engine.pool")
# a restart is late (its end no longer predictable) past twice its last start's time plus a second: a loaded
# box starts a worker slower than the idle one did
RESTART_LATE_FACTOR, RESTART_LATE_S = 2.0, 1.0


class WorkerPool:
    def __init__(self, sampler=None):
        """``sampler``: an optional running ``homepd.hw.monitor.Sampler``; worker pids are registered with it."""
        self.sampler = sampler
        self.handles: dict[str, WorkerHandle] = {}    # worker name -> its handle (the controller's ``workers``)
        self.tasks: set[asyncio.Task] = set()
        self.restarting: dict[str, asyncio.Task] = {}  # worker name -> its restart in progress
        self.restart_started_s: dict[str, float] = {}   # worker name -> when its latest restart began
        self.store: StoreBook | None = None  # the KV store tier's segments and what they hold

    async def start(self) -> None:
        """Start every handle and wait until each has loaded its model."""
        await asyncio.gather(*(h.start() for h in self.handles.values()))
        for handle in self.handles.values():
            self.register(handle)

    async def stop(self, keep_store: bool = False) -> StoreBook | None:
        """Stop every worker; the KV store is closed, or with ``keep_store`` handed back (what it holds survives
        for a later engine of the same model: ``open_store``'s ``kept``)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(h.stop() for h in self.handles.values()))
        for handle in self.handles.values():
            self.unregister(handle.pid)
        store, self.store = self.store, None
        if store is not None and not keep_store:
            store.close()
            store = None
        return store

    def open_store(self, n_bytes: int, kept: StoreBook | None = None) -> None:
        """The KV store tier of ``n_bytes``: a segment per worker with a prefix cache (the budget split
        evenly), each attached by its worker before its first request (the message waits in its backlog).
        ``kept``: the store an earlier engine of this model kept (``stop(keep_store=True)``), reused with what
        it holds when it has a segment for each of these workers, else closed."""
        cached = [h for h in self.handles.values() if h.spec.max_cached_cells > 0]
        if kept is not None and (not n_bytes or set(kept.segments) != {h.role for h in cached}):
            kept.close()
            kept = None
        if not n_bytes or not cached:
            return
        self.store = kept if kept is not None else StoreBook({h.role: n_bytes // len(cached) for h in cached})
        for handle in cached:
            self.attach_store(handle)

    def attach_store(self, handle: WorkerHandle) -> None:
        """Queue the store's attach message first in a (re)starting worker's backlog."""
        msg = self.store.attach_message(handle.role) if self.store is not None else None
        if msg is not None:
            handle.backlog.appendleft((None, msg))

    def register(self, handle: WorkerHandle) -> None:
        if self.sampler is not None and handle.pid is not None:
            self.sampler.register_process(handle.pid, handle.role)

    def unregister(self, pid: int | None) -> None:
        if self.sampler is not None and pid is not None:
            self.sampler.unregister_process(pid)

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, kept referenced; its failure is logged, never lost."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("engine background task failed", exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def spawn_restart(self, name: str, coro) -> None:
        self.restarting[name] = self.spawn(coro)
        self.restart_started_s[name] = time.monotonic()

    def restart_eta_s(self, now_s: float) -> float | None:
        """Seconds until every restart in progress should be back: each worker's last load time from when its
        restart began (0 when none restarts; None when it is not known: a restarting worker never reported a
        load time, or its restart is already later than that)."""
        left = [0.0]
        for name, task in self.restarting.items():
            load_s = getattr(self.handles.get(name), "last_load_s", None)
            if task.done():
                continue
            if load_s is None:
                return None
            started_s = self.restart_started_s.get(name, now_s)
            if now_s > started_s + RESTART_LATE_FACTOR * load_s + RESTART_LATE_S:
                return None  # why: this late, something is wrong with it (a file it cannot load, a retry backoff)
            left.append(started_s + load_s - now_s)
        return max(0.0, *left)

    async def wait_restarts(self) -> None:
        """Return once every restart in progress has ended (the worker is back, or marked failed)."""
        while self.restarting:
            await asyncio.gather(*self.restarting.values(), return_exceptions=True)
            self.restarting = {r: t for r, t in self.restarting.items() if not t.done()}

    def measure_memory(self, model_path: str, arena_names: tuple[str, ...] = ()) -> MemoryBreakdown:
        """Every homepd process now (controller, workers, KV arena) by what holds the memory (reads /proc).
        ``arena_names``: the KV arena's segments (none without one)."""
        processes = [ProcessRegions("controller", os.getpid())] + [
            ProcessRegions(h.role, h.pid, h.ready.memory_regions, h.ready.kv_cache_bytes)
            for h in list(self.handles.values()) if h.ready is not None and h.pid is not None]
        return measure_processes(processes, model_path, arena_names)
