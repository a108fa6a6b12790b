"""The controller: the workers, the requests sent to them, the dispatch of their messages, and their deaths.

Used by every face (service, dashboard, benchmarks) through its requests (``submit``, ``cancel``) and its
read API (``snapshot``, ``health``, ``is_running``, ``finished_since``, ``steps_since``...).  Runs on an
asyncio loop that also reads every worker's pipe, so a worker's death (pipe EOF) is noticed at once.
The requests themselves (streams, finished records, the step log, the one place a request ends): the request
table (``homepd.engine.requests``); which workers, which entry worker and which failures are fatal: the mode's
topology (``homepd.engine.topology``), whose handoff relays disaggregation's KV; admission and routing policy:
the gate (``homepd.engine.gate``); what to do about a dead worker: ``homepd.engine.recovery`` (pure), applied
here.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from homepd.backends import model_classes
from homepd.config import EngineConfig, kv_stream_cells, kv_streams, request_n_ctx
from homepd.core.admission import AdmissionRejected, Verdict
from homepd.core.terms import RequestClass, StepEstimate
from homepd.chat.format import ChatFormat, detect as detect_chat_format
from homepd.core.lifecycle import RESUMED_FROM_EXTENT, Lifecycle, RequestState
from homepd.core.protocol import (EngineSetup, Heartbeat, KVHandoff, KVImported, KVPreempted,
                                  PrefixCacheStats, PrefixReused, RequestDone, StepRecord, StepReport, StoreDropped,
                                  StoreSaved, SubmitRequest, WorkerFatal, WorkerReady, WorkerSpec)
from homepd.core.protocol import CachedPrefixesSaved, SaveCachedPrefixes
from homepd.core.records import EngineSnapshot, FinishReason, MemoryBreakdown, WorkerEvent, WorkerEventKind
from homepd.core.sampling import SamplingParams
from homepd.engine import recovery
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import AdmissionGate
from homepd.engine.handles import WorkerHandle, watch_for_hangs
from homepd.engine.pool import WorkerPool
from homepd.engine.prompt import ChatExtras, request_tokens
from homepd.engine.requests import RequestTable
from homepd.engine.specs import worker_specs
from homepd.engine.streams import RequestStream
from homepd.engine.topology import Health, topology_for
from homepd.engine.topology.handoff import NoHandoff
from homepd.errors import EngineError, RequestError
from homepd.kv.segment import cleanup_stale_segments

MAX_WORKER_EVENTS = 1_000
_ids = itertools.count(1)


class Engine:
    def __init__(self, config: EngineConfig, setup: EngineSetup, sampler=None, kept_store=None):
        """``setup``: the resolved model and worker placements (``homepd.launch.prepare``).
        ``sampler``: an optional running ``homepd.hw.monitor.Sampler``; worker pids are registered with it.
        ``kept_store``: the KV store an earlier engine of the same model and settings kept when it stopped
        (``stop(keep_store=True)``): its saved prefixes are restored from on a hit."""
        self._kept_store = kept_store
        self._prefix_saves: dict[str, asyncio.Future] = {}  # worker name -> its SaveCachedPrefixes' answer
        self.config = config.validated()
        self.topology = topology_for(self.config.mode)
        self.setup = setup
        self.pool = WorkerPool(sampler)  # the processes: start, stop, restart, hang watch, memory; the KV store
        self.model_path = setup.model_path
        self.model_fingerprint = setup.model_fingerprint
        self.tokenizer = None
        self.chat_format: ChatFormat | None = None  # the template's tool-call and reasoning format, once started
        self.worker_events: deque[WorkerEvent] = deque(maxlen=MAX_WORKER_EVENTS)  # deaths and restarts
        self.workers: dict[str, WorkerHandle] = self.pool.handles
        self.memory: MemoryBreakdown | None = None  # as last measured (measure_memory)
        self.gate = AdmissionGate(self.config)  # measures, predicts, admits and routes (two queues, two budgets)
        self.affinity = PrefixAffinity()  # which prompt prefixes each worker probably holds (cache-aware routing)
        # the running and finished requests, the step log; the one place a request ends
        self.requests = RequestTable(self.workers, self.gate, self.affinity, self.config.n_seq_max)
        self.step_listeners = self.requests.step_listeners  # called with each StepRecord once it is applied
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="homepd-prepare")

    # lifecycle of the engine -----------------------------------------------------
    @property
    def handoff(self):
        """The mode's KV handoff between workers (disaggregated: the arena's); the request table tells it of ends."""
        return self.requests.handoff

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        model_cls, _ = model_classes(self.config.backend)
        self.tokenizer = await asyncio.to_thread(model_cls, self.model_path, 0, True)
        self.chat_format = detect_chat_format(self.tokenizer.chat_template())
        if self.topology.uses_kv_arena or self.setup.kv_store_bytes:
            await asyncio.to_thread(cleanup_stale_segments)  # segments of dead controllers
        for name, spec in worker_specs(self.config, self.setup).items():
            self.workers[name] = WorkerHandle(name, spec, self._loop, self._on_message, self._on_exit)
        try:
            kept, self._kept_store = self._kept_store, None
            self.pool.open_store(self.setup.kv_store_bytes, kept)
            await self.pool.start()
            self.requests.handoff = self.topology.make_handoff(self.config, self.setup, self.workers)
            for handle in self.workers.values():
                self.handoff.attach(handle)
            await asyncio.to_thread(self.measure_memory)
            if self.config.hang_timeout_s:
                self.pool.spawn(watch_for_hangs(self.workers, self.config.hang_timeout_s, lambda: self._stopping))
        except BaseException:
            await self.stop()
            raise

    async def stop(self, keep_store: bool = False):
        """Stop the workers and end what still runs; with ``keep_store`` the KV store is not closed but
        returned (a ``StoreBook``, or None without one), for the model's next engine (``kept_store``)."""
        self._stopping = True
        if self._kept_store is not None:  # never started: the store it was given is closed with it
            self._kept_store.close()
            self._kept_store = None
        store = await self.pool.stop(keep_store)
        for rid in list(self.requests.streams):
            self.requests.end(rid, RequestState.FAILED, time.monotonic(), error="engine stopped")
        self.handoff.close()
        self.requests.handoff = NoHandoff()
        await asyncio.to_thread(self._prepare_pool.shutdown, cancel_futures=True)  # no tokenize after close
        if self.tokenizer is not None:
            self.tokenizer.close()
            self.tokenizer = None
        return store

    async def save_prefixes(self, timeout_s: float = 30.0) -> int:
        """Have every worker with a KV store save the prefixes cached in its context into it (before a
        ``stop(keep_store=True)``: the hottest are kept when the store is full); the entries the store then
        holds.  A worker that does not answer within ``timeout_s`` saves what it saved."""
        store = self.pool.store
        if store is None:
            return 0
        loop = asyncio.get_running_loop()
        for name, handle in self.workers.items():
            if handle.role in store.segments and handle.is_alive and handle.ready is not None:
                self._prefix_saves[name] = loop.create_future()
                handle.send(SaveCachedPrefixes())
        try:
            await asyncio.wait_for(asyncio.gather(*self._prefix_saves.values()), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._prefix_saves.clear()
        return sum(len(entries) for entries in store.entries.values())

    def _on_prefixes_saved(self, handle: WorkerHandle, msg: CachedPrefixesSaved) -> None:
        future = self._prefix_saves.get(handle.role)
        if future is not None and not future.done():
            future.set_result(msg.n_entries)

    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def restart_eta_s(self) -> float | None:
        """Seconds until the workers restarting now should be back (0: none restarts; None: not known)."""
        return self.pool.restart_eta_s(time.monotonic())

    async def wait_restarts(self) -> None:
        """Return once every worker restart in progress has ended (the worker is back, or marked failed)."""
        await self.pool.wait_restarts()

    # requests ---------------------------------------------------------------------
    def prepare(self, prompt: str | None = None, messages: list | None = None, params: SamplingParams | None = None,
                chat: ChatExtras | None = None) -> list[int]:
        """Render and tokenize a prompt or chat, and check it can run (``homepd.engine.prompt.request_tokens``)."""
        if self.tokenizer is None:
            raise EngineError("the engine is not started")
        return request_tokens(self.tokenizer, request_n_ctx(self.config), prompt, messages, params, chat,
                              streams=kv_streams(self.config))

    async def submit(self, prompt: str | None = None, *, messages: list | None = None,
                     params: SamplingParams | None = None, request_id: str | None = None,
                     request_class: RequestClass | None = None, chat: ChatExtras | None = None) -> RequestStream:
        """Admit a request; returns its event stream.  Raises RequestError before any worker sees it.

        Its clock starts here, before the chat template and the tokenizer run: TTFT is what a caller sees.
        """
        arrived_s = time.monotonic()
        if request_class is not None and not isinstance(request_class, RequestClass):
            raise TypeError(f"request_class must be a RequestClass (parsed at the edge), got {request_class!r}")
        klass = RequestClass.INTERACTIVE if request_class is None else request_class
        params = (params or SamplingParams()).validated()
        # why: off the loop (llama_tokenize releases the GIL), one at a time: a long chat must not stall the
        # pipes, /health or the watchdog, and concurrent tokenizer calls gain nothing on a shared vocabulary
        if self._stopping:
            raise EngineError("the engine is stopping")
        ids = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.prepare, prompt, messages,
                                                               params, chat)
        if self._stopping:
            raise EngineError("the engine is stopping")
        failed = self.topology.fatal_failures(self.workers)
        if failed:
            raise EngineError(f"the {failed[0].role} worker could not be restarted ({failed[0].failed}); "
                              "stop and start the engine")
        room = request_n_ctx(self.config) - len(ids) + 1
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)  # ends with finish_reason 'length'
        rid = request_id or f"req-{os.getpid()}-{next(_ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already running")
        routed = self.topology.route_new(self.config, self.workers, self.handoff.router, self.gate,
                                         self.requests.worker_load, len(ids),
                                         cached=lambda h: self.affinity.cached(h, ids), request_class=klass)
        worker = routed.worker
        decision = self.gate.decide(klass, len(ids) - routed.n_cached_tokens, worker.role, worker.spec,
                                    self.requests.worker_load(worker))
        if decision is not None and decision.verdict is Verdict.REJECT:
            raise AdmissionRejected(f"{klass.value} request rejected early: {decision.reason}; retry after "
                                    f"{decision.retry_after_s:g} s", decision.retry_after_s, klass,
                                    decision.predicted_ttft_ms)
        lifecycle = Lifecycle(request_id=rid, arrived_s=arrived_s, n_prompt_tokens=len(ids),
                              request_class=klass,
                              predicted_ttft_s=decision.predicted_ttft_ms / 1e3 if decision else None,
                              admission=decision.verdict.value if decision else Verdict.ADMIT.value,
                              routed_to=worker.role, route_reason=routed.reason.value,
                              route_cached_tokens=routed.n_cached_tokens)
        self.gate.note_route(routed.reason)
        stream = RequestStream(rid, lifecycle, tuple(ids), params)
        self.requests.add(stream)
        worker.send_request(rid, SubmitRequest(rid, tuple(ids), params, request_class=klass,
                                               deadline_s=self.gate.deadline_s(lifecycle)))
        self.affinity.holds(worker, ids)
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request; True if it was running.  Its stream ends with finish_reason 'cancelled'."""
        return self.requests.cancel(request_id)

    def _entry_worker(self, avoid: WorkerHandle | None = None, n_tokens: int = 0) -> WorkerHandle:
        return self.topology.entry_worker(self.workers, self.handoff.router, n_tokens, avoid)

    # messages from workers (on the loop thread) -------------------------------------
    def _on_message(self, handle: WorkerHandle, msg) -> None:
        self._HANDLERS[type(msg)](self, handle, msg)

    def _on_fatal(self, handle: WorkerHandle, msg: WorkerFatal) -> None:
        handle.last_error = msg.error.splitlines()[0] if msg.error else "unknown error"

    # worker message type -> what it does: most move requests (the request table), the KV handoff's go to the
    # mode's handoff, the KV store's to the store
    _HANDLERS = {
        StepReport: lambda self, handle, msg: self.requests.step(handle, msg),
        RequestDone: lambda self, handle, msg: self.requests.done(msg),
        KVPreempted: lambda self, handle, msg: self.requests.preempted(msg),
        PrefixReused: lambda self, handle, msg: self.requests.reused(msg),
        KVHandoff: lambda self, handle, msg: self.handoff.on_message(self.requests, msg),
        KVImported: lambda self, handle, msg: self.handoff.on_message(self.requests, msg),
        StoreSaved: lambda self, handle, msg: self.pool.store.saved(handle.role, msg),
        StoreDropped: lambda self, handle, msg: self.pool.store.dropped(handle.role, msg),
        WorkerReady: lambda self, handle, msg: None,  # the handle keeps it
        Heartbeat: lambda self, handle, msg: None,    # it only proves the worker alive
        WorkerFatal: _on_fatal,
        CachedPrefixesSaved: _on_prefixes_saved,
    }

    # when a worker dies (decided by homepd.engine.recovery, applied here) -----------------
    def _on_exit(self, handle: WorkerHandle, exitcode: int | None) -> None:
        """A worker process ended.  Resume, cancel or fail what it held, then restart it (unless stopping)."""
        if self._stopping:
            return
        now, pid = time.monotonic(), handle.pid
        cause = f"exit code {exitcode}" + (f": {handle.last_error}" if handle.last_error else "")
        handle.deaths.append(now)
        crash_loop = recovery.is_crash_loop(list(handle.deaths), now)
        held = sorted(handle.in_flight)
        handle.in_flight.clear()
        self.affinity.forget(handle)
        handle.backlog.clear()
        self.pool.attach_store(handle)  # its replacement finds the conversations this one saved
        wanted = {rid for rid in held if self.requests.is_wanted(rid)}
        intact = self.handoff.recover(handle.spec.role, pid, wanted if self.config.resume and not crash_loop else set())
        plan = recovery.plan_recovery(recovery.WorkerDeath(
            role=handle.role, pid=pid, cause=cause, is_crash_loop=crash_loop, resume=self.config.resume,
            n_ctx=request_n_ctx(self.config), entry_worker_failed=bool(self._entry_worker(avoid=handle).failed),
            held=self.requests.held(held, intact)))
        self.worker_events.append(WorkerEvent(
            WorkerEventKind.DIED, handle.role, pid, now, exitcode=exitcode, cause=cause, crash_loop=crash_loop,
            failed_requests=tuple(rid for rid, _ in plan.fail), resumed_from_extent=plan.from_extent,
            recomputed_requests=plan.recompute))
        for rid in plan.cancel:  # the cancel died with the worker: honour it
            self.requests.end(rid, RequestState.CANCELLED, now, reason=FinishReason.CANCELLED)
        for rid, error in plan.fail:
            self.requests.end(rid, RequestState.FAILED, now, error=error)
        handle.last_error = None
        self.pool.unregister(pid)
        if not plan.restart:
            handle.failed = plan.failed_reason
            self.worker_events.append(WorkerEvent(WorkerEventKind.FAILED, handle.role, pid, now,
                                                  cause=plan.failed_reason or ""))
            return
        for rid in plan.from_extent:  # KV intact in its extent: the restarted decode worker imports it
            self.requests.streams[rid].note_resume(RESUMED_FROM_EXTENT)
            self.handoff.resume(rid, handle)
        for rid in plan.recompute:  # KV lost: prefill prompt + output again on the (restarted) entry worker
            stream = self.requests.streams[rid]
            stream.note_resume("recompute")
            self.handoff.forget(rid)
            request = stream.resubmission(self.tokenizer.token_to_piece, self.gate.deadline_s(stream.lifecycle))
            entry = self._entry_worker(avoid=handle, n_tokens=len(request.prompt_ids))
            entry.send_request(rid, request)
            self.affinity.holds(entry, request.prompt_ids)
        self.pool.spawn_restart(handle.role, self._restart(handle, died_s=now))

    async def _restart(self, handle: WorkerHandle, died_s: float) -> None:
        error = await handle.restart(recovery.RESTART_ATTEMPTS, recovery.RESTART_BACKOFF_S)
        if error is not None:  # could not come back: fail what waits for it, refuse new work
            handle.failed = f"{error}"
            self.worker_events.append(WorkerEvent(WorkerEventKind.FAILED, handle.role, None, time.monotonic(),
                                                  cause=f"could not be restarted: {error}"))
            for rid in sorted(handle.in_flight):
                self.requests.end(rid, RequestState.FAILED, time.monotonic(),
                                  error=f"{handle.role} worker could not be restarted: {error}")
            return
        self.pool.register(handle)
        self.handoff.attach(handle, restarted=True)
        # why its ready time, not now: its backlog was sent at once, and this task may resume only after the
        # replacement has already finished a resumed request (seen on a loaded box)
        now = handle.ready_s if handle.ready_s is not None else time.monotonic()
        self.worker_events.append(WorkerEvent(WorkerEventKind.RESTARTED, handle.role, handle.pid, now,
                                              recovery_s=now - died_s))

    # the read API of the faces (they never read the tables themselves) ------------------
    def health(self) -> Health:
        """Which failed workers make the engine unusable, and whether a worker is (re)starting."""
        return self.topology.health(self.workers)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.requests

    def finished_since(self, t_s: float) -> list[Lifecycle]:
        """The requests that ended after ``t_s`` (monotonic), oldest first (``RequestTable.finished_since``)."""
        return self.requests.finished_since(t_s)

    def steps_since(self, t_s: float = float("-inf")) -> list[StepRecord]:
        """The steps that ended at or after ``t_s`` (monotonic), in the order they arrived
        (``RequestTable.steps_since``)."""
        return self.requests.steps_since(t_s)

    def last_steps(self, n: int) -> list[StepRecord]:
        return self.requests.last_steps(n)

    def n_streaming(self) -> int:
        """Running requests that have their first token."""
        return self.requests.n_streaming()

    def kv_peak(self, t0_s: float, t1_s: float) -> tuple[int, int]:
        """(peak arena bytes in use, KV bytes in transit then) between two monotonic times; (0, 0): no arena."""
        return self.handoff.peak_usage(t0_s, t1_s)

    def cache_stats(self) -> dict[str, PrefixCacheStats]:
        """Worker name -> its prefix cache's latest stats (workers without a cache are left out)."""
        return {name: h.cache_stats for name, h in self.workers.items() if h.cache_stats is not None}

    def worker_pid(self, name: str) -> int | None:
        return self.workers[name].pid

    def worker_specs(self) -> dict[str, WorkerSpec]:
        """Each worker's spec, by name: what its step policy and scheduler are built from (the twin builds its
        simulated workers from them, ``homepd.twin``)."""
        return {name: h.spec for name, h in self.workers.items()}

    def step_estimate(self, name: str) -> StepEstimate | None:
        """The step-time estimate worker ``name`` last published, once trusted (``AdmissionGate.estimate``)."""
        return self.gate.estimate(name)

    def snapshot(self) -> EngineSnapshot:
        """A picture of the engine: workers, queues, the KV arena, running requests, recent worker events."""
        by_class = self.requests.by_class()
        return EngineSnapshot(
            mode=self.config.mode, model=self.model_path, n_ctx=self.config.n_ctx, chunk=self.config.chunk,
            workers=tuple(h.snapshot() for h in self.workers.values()),
            kv_arena=self.handoff.snapshot(),
            requests=self.requests.by_state(), n_steps=len(self.requests.step_log),
            requests_by_class=by_class, worker_events=tuple(self.worker_events), t_s=time.monotonic(),
            memory=self.memory, admission=self.gate.snapshot(self.requests.load(self.requests.streams), by_class),
            cache=self.cache_stats(),
            kv_stream_cells=kv_stream_cells(self.config))

    def measure_memory(self) -> MemoryBreakdown:
        """Measure every homepd process now (controller, workers, KV arena) by what holds the memory; also kept
        as ``snapshot().memory``.  Reads /proc (a few ms): call it off the event loop when serving."""
        router = self.handoff.router
        self.memory = self.pool.measure_memory(self.model_path, router.arena.names if router is not None else ())
        return self.memory
