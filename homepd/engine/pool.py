"""The worker processes of one engine, as a set: started and stopped together, registered with the
hardware sampler, restarted in the background, watched for hangs, measured; and the engine's background
tasks.  What a worker's messages and death mean for the requests is the controller's."""
from __future__ import annotations

import asyncio
import logging
import os

from homepd.core.records import MemoryBreakdown
from homepd.engine.handles import WorkerHandle

log = logging.getLogger("homepd.engine.pool")


class WorkerPool:
    def __init__(self, sampler=None):
        """``sampler``: an optional running ``homepd.hw.monitor.Sampler``; worker pids are registered with it."""
        self.sampler = sampler
        self.handles: dict[str, WorkerHandle] = {}    # worker name -> its handle (the controller's ``workers``)
        self.tasks: set[asyncio.Task] = set()
        self.restarting: dict[str, asyncio.Task] = {}  # worker name -> its restart in progress

    async def start(self) -> None:
        """Start every handle and wait until each has loaded its model."""
        await asyncio.gather(*(h.start() for h in self.handles.values()))
        for handle in self.handles.values():
            self.register(handle)

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(h.stop() for h in self.handles.values()))
        for handle in self.handles.values():
            self.unregister(handle.pid)

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

    async def wait_restarts(self) -> None:
        """Return once every restart in progress has ended (the worker is back, or marked failed)."""
        while self.restarting:
            await asyncio.gather(*self.restarting.values(), return_exceptions=True)
            self.restarting = {r: t for r, t in self.restarting.items() if not t.done()}

    def measure_memory(self, model_path: str) -> MemoryBreakdown:
        """Every homepd process now (controller, workers, KV arena) by what holds the memory (reads /proc)."""
        from homepd.hw.smaps import ProcessRegions, measure_processes

        processes = [ProcessRegions("controller", os.getpid())] + [
            ProcessRegions(h.role, h.pid, h.ready.memory_regions, h.ready.kv_cache_bytes)
            for h in list(self.handles.values()) if h.ready is not None and h.pid is not None]
        return measure_processes(processes, model_path)
