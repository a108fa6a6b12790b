"""The controller: the request table, and the worker messages and deaths that move it.

Used by every face (service, dashboard, benchmarks) through its requests (``submit``, ``cancel``) and its
read API (``snapshot``, ``health``, ``is_running``, ``finished_since``, ``steps_since``...).  Runs on an
asyncio loop that also reads every worker's pipe, so a worker's death (pipe EOF) is noticed at once.
Which workers, which entry worker and which failures are fatal: the mode's topology
(``homepd.engine.topology``); admission and routing policy: the gate (``homepd.engine.gate``);
disaggregation's arena bookkeeping: ``homepd.kv.router``; what to do about a dead worker:
``homepd.engine.recovery`` (pure), applied here.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterable

from homepd.config import EngineConfig
from homepd.core.admission import RequestClass, Verdict
from homepd.core.chatformat import ChatFormat, detect as detect_chat_format
from homepd.core.lifecycle import Lifecycle, RequestState, end_state
from homepd.core.modes import Role
from homepd.core.protocol import (CancelRequest, EngineSetup, Heartbeat, KVPreempted, RequestDone,
                                  PrefixCacheStats, PrefixReused, StoreDropped, StoreSaved,
                                  StepRecord, StepReport, SubmitRequest, WorkerFatal, WorkerReady)
from homepd.core.records import EngineSnapshot, FinishReason, MemoryBreakdown, WorkerEvent, WorkerEventKind
from homepd.core.sampling import SamplingParams
from homepd.core.stepmodel import StepEstimate
from homepd.engine import recovery
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import AdmissionGate, WorkerLoad, load_of
from homepd.engine.handles import WorkerHandle, watch_for_hangs
from homepd.engine.pool import WorkerPool
from homepd.engine.prompt import ChatExtras, request_tokens
from homepd.engine.streams import Event, EventKind, RequestStream
from homepd.engine.topology import Health, topology_for
from homepd.engine.topology.handoff import NoHandoff
from homepd.errors import AdmissionRejected, EngineError, RequestError

# finished request records kept for finished_since (the app's embedded source reads them every tick; the
# service's consumers are told at the end); each holds its token times: 10,000 grew the controller by ~20 MB
MAX_RECORDS = 1_000
# the step log keeps the newest steps within ~32 MiB: a StepRecord measures ~450 B plus ~8 B per decode id and
# ~100 B per prefill entry (tracemalloc), so this many at worst (every sequence in both lists) fit
STEP_LOG_BYTES = 32 << 20


def step_log_len(n_seq_max: int) -> int:
    return STEP_LOG_BYTES // (512 + 128 * n_seq_max)
MAX_WORKER_EVENTS = 1_000
_ids = itertools.count(1)


class Engine:
    def __init__(self, config: EngineConfig, setup: EngineSetup, sampler=None):
        """``setup``: the resolved model and worker placements (``homepd.launch.prepare``).
        ``sampler``: an optional running ``homepd.hw.monitor.Sampler``; worker pids are registered with it."""
        self.config = config.validated()
        self.topology = topology_for(self.config.mode)
        self.setup = setup
        self.pool = WorkerPool(sampler)  # the processes: start, stop, restart, hang watch, memory; the KV store
        self.model_path = setup.model_path
        self.model_fingerprint = setup.model_fingerprint
        self.tokenizer = None
        self.chat_format: ChatFormat | None = None  # the template's tool-call and reasoning format, once started
        self.records: OrderedDict[str, Lifecycle] = OrderedDict()  # finished requests, newest last
        self.streams: dict[str, RequestStream] = {}                # running requests
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_len(self.config.n_seq_max))
        self.step_listeners: list = []  # called with each StepRecord once its tokens and ends are applied
        self.worker_events: deque[WorkerEvent] = deque(maxlen=MAX_WORKER_EVENTS)  # deaths and restarts
        self.workers: dict[str, WorkerHandle] = self.pool.handles
        self.handoff = NoHandoff()  # the mode's KV handoff between workers (disaggregated: the arena's)
        self.memory: MemoryBreakdown | None = None  # as last measured (measure_memory)
        self.cancelling: set[str] = set()
        self.gate = AdmissionGate(self.config)  # measures, predicts, admits and routes (two queues, two budgets)
        self.affinity = PrefixAffinity()  # which prompt prefixes each worker probably holds (cache-aware routing)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="homepd-prepare")

    # lifecycle of the engine -----------------------------------------------------
    async def start(self) -> None:
        from homepd.backends import model_classes
        from homepd.engine.specs import worker_specs
        from homepd.kv.segment import cleanup_stale_segments

        self._loop = asyncio.get_running_loop()
        model_cls, _ = model_classes(self.config.backend)
        self.tokenizer = await asyncio.to_thread(model_cls, self.model_path, 0, True)
        self.chat_format = detect_chat_format(self.tokenizer.chat_template())
        if self.topology.uses_kv_arena or self.setup.kv_store_bytes:
            await asyncio.to_thread(cleanup_stale_segments)  # segments of dead controllers
        for name, spec in worker_specs(self.config, self.setup).items():
            self.workers[name] = WorkerHandle(name, spec, self._loop, self._on_message, self._on_exit)
        try:
            self.pool.open_store(self.setup.kv_store_bytes)
            await self.pool.start()
            self.handoff = self.topology.make_handoff(self.config, self.setup, self.workers)
            for handle in self.workers.values():
                self.handoff.attach(handle)
            await asyncio.to_thread(self.measure_memory)
            if self.config.hang_timeout_s:
                self.pool.spawn(watch_for_hangs(self.workers, self.config.hang_timeout_s, lambda: self._stopping))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        self._stopping = True
        await self.pool.stop()
        for rid in list(self.streams):
            self.end_request(rid, RequestState.FAILED, time.monotonic(), error="engine stopped")
        self.handoff.close()
        self.handoff = NoHandoff()
        await asyncio.to_thread(self._prepare_pool.shutdown, cancel_futures=True)  # no tokenize after close
        if self.tokenizer is not None:
            self.tokenizer.close()
            self.tokenizer = None

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
        return request_tokens(self.tokenizer, self.config.n_ctx, prompt, messages, params, chat)

    async def submit(self, prompt: str | None = None, *, messages: list | None = None,
                     params: SamplingParams | None = None, request_id: str | None = None,
                     request_class: str | None = None, chat: ChatExtras | None = None) -> RequestStream:
        """Admit a request; returns its event stream.  Raises RequestError before any worker sees it.

        Its clock starts here, before the chat template and the tokenizer run: TTFT is what a caller sees.
        """
        arrived_s = time.monotonic()
        try:
            klass = RequestClass.parse(request_class)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
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
        room = self.config.n_ctx - len(ids) + 1
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)  # ends with finish_reason 'length'
        rid = request_id or f"req-{os.getpid()}-{next(_ids)}"
        if rid in self.streams:
            raise RequestError(f"request id {rid!r} is already running")
        routed = self.topology.route_new(self.config, self.workers, self.handoff.router, self.gate,
                                         lambda h: self._load(h.in_flight), len(ids),
                                         cached=lambda h: self.affinity.cached(h, ids), request_class=klass)
        worker = routed.worker
        decision = self.gate.decide(klass, len(ids) - routed.n_cached_tokens, worker.role, worker.spec,
                                    self._load(worker.in_flight))
        if decision is not None and decision.verdict is Verdict.REJECT:
            raise AdmissionRejected(f"{klass.value} request rejected early: {decision.reason}; retry after "
                                    f"{decision.retry_after_s:g} s", decision.retry_after_s, klass.value,
                                    decision.predicted_ttft_ms)
        lifecycle = Lifecycle(request_id=rid, arrived_s=arrived_s, n_prompt_tokens=len(ids),
                              request_class=klass.value,
                              predicted_ttft_s=decision.predicted_ttft_ms / 1e3 if decision else None,
                              admission=decision.verdict.value if decision else Verdict.ADMIT.value,
                              routed_to=worker.role, route_reason=routed.reason.value,
                              route_cached_tokens=routed.n_cached_tokens)
        self.gate.note_route(routed.reason)
        stream = RequestStream(rid, lifecycle, tuple(ids), params)
        self.streams[rid] = stream
        worker.send_request(rid, SubmitRequest(rid, tuple(ids), params, request_class=klass.value,
                                               deadline_s=self.gate.deadline_s(lifecycle)))
        self.affinity.holds(worker, ids)
        return stream

    def _load(self, request_ids: Iterable[str]) -> WorkerLoad:
        """What these running requests (a worker's, or all) hold (``homepd.engine.gate.load_of``)."""
        return load_of(self.streams[rid].lifecycle for rid in request_ids if rid in self.streams)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request; True if it was running.  Its stream ends with finish_reason 'cancelled'."""
        if request_id not in self.streams:
            return False
        self.cancelling.add(request_id)
        for handle in list(self.workers.values()):
            if request_id in handle.in_flight:
                if handle.drop_backlog(request_id):
                    self.end_request(request_id, RequestState.CANCELLED, time.monotonic(), reason=FinishReason.CANCELLED)
                else:
                    handle.send(CancelRequest(request_id))
        return True

    def lifecycle(self, request_id: str) -> Lifecycle | None:
        """The lifecycle of a running or recently finished request."""
        stream = self.streams.get(request_id)
        return stream.lifecycle if stream is not None else self.records.get(request_id)

    def _entry_worker(self, avoid: WorkerHandle | None = None, n_tokens: int = 0) -> WorkerHandle:
        return self.topology.entry_worker(self.workers, self.handoff.router, n_tokens, avoid)

    # messages from workers (on the loop thread) -------------------------------------
    def _on_message(self, handle: WorkerHandle, msg) -> None:
        if self.handoff.handles(msg):  # KVHandoff, KVImported: the mode's own flow
            self.handoff.on_message(self, msg)
        else:
            self._HANDLERS[type(msg)](self, handle, msg)

    def _on_preempted(self, handle: WorkerHandle, msg: KVPreempted) -> None:
        """The full KV context re-queued it on its worker: its prompt (and output so far) is prefilled again."""
        if msg.request_id in self.streams:
            lc = self.streams[msg.request_id].lifecycle
            lc.n_kv_preemptions += 1
            lc.n_prefilled = 0

    def _on_reused(self, handle: WorkerHandle, msg: PrefixReused) -> None:
        """Its prompt starts from a cached prefix, not recomputed."""
        if msg.request_id in self.streams:
            self.streams[msg.request_id].lifecycle.n_cached_tokens = msg.n_tokens

    def _on_fatal(self, handle: WorkerHandle, msg: WorkerFatal) -> None:
        handle.last_error = msg.error.splitlines()[0] if msg.error else "unknown error"

    def _on_step(self, handle: WorkerHandle, report: StepReport) -> None:
        step = report.step
        if step.worker_role != handle.role:  # a replica: name the step after its worker
            step = replace(step, worker_role=handle.role)
        self.step_log.append(step)
        self.gate.observe(handle.role, step, report.estimate)
        if report.cache is not None:
            handle.cache_stats = report.cache
        for rid, n in step.prefill:
            if rid in self.streams:
                self.streams[rid].lifecycle.n_prefilled += n
        for rid in report.prefill_started:
            if rid in self.streams:
                self.streams[rid].lifecycle.advance(RequestState.PREFILLING, step.t_start_s)
        after_prefill = RequestState.TRANSFERRING if handle.spec.role is Role.PREFILL else RequestState.DECODING
        for rid in report.prefill_ended:
            if rid in self.streams:
                lc = self.streams[rid].lifecycle
                lc.prefill_end_s = step.t_end_s
                lc.advance(after_prefill, step.t_end_s)
        for tok in report.tokens:
            stream = self.streams.get(tok.request_id)
            if stream is not None:
                stream.token_ids.append(tok.token_id)
                stream.lifecycle.add_token(tok.t_s)
                stream.queue.put_nowait(Event(EventKind.TOKEN, tok.request_id, tok.t_s, tok.token_id, tok.text,
                                              logprob=tok.logprob))
        for done in report.done:
            self._on_done(done)
        for listener in self.step_listeners:
            listener(step)

    def _on_done(self, done: RequestDone) -> None:
        if done.kv_full and done.request_id in self.streams:
            self.streams[done.request_id].lifecycle.ended_by_kv_full = True
        self.end_request(done.request_id, end_state(done.reason), done.t_s, reason=done.reason, text=done.text,
                  error=done.error)

    # the dispatch of worker messages (the mode's handoff messages go to its handoff first)
    _HANDLERS = {
        StepReport: lambda self, handle, msg: self._on_step(handle, msg),
        RequestDone: lambda self, handle, msg: self._on_done(msg),
        KVPreempted: _on_preempted,
        PrefixReused: _on_reused,
        StoreSaved: lambda self, handle, msg: self.pool.store.saved(handle.role, msg),
        StoreDropped: lambda self, handle, msg: self.pool.store.dropped(handle.role, msg),
        WorkerReady: lambda self, handle, msg: None,  # the handle keeps it
        Heartbeat: lambda self, handle, msg: None,    # it only proves the worker alive
        WorkerFatal: _on_fatal,
    }

    def end_request(self, rid: str, state: RequestState, t_s: float, reason: FinishReason | None = None, text: str = "",
             error: str | None = None) -> None:
        """The one place a request ends: its stream gets its last event, its resources are freed."""
        stream = self.streams.pop(rid, None)
        self.cancelling.discard(rid)
        self.handoff.ended(rid)
        if stream is None:
            return
        holder = next((h for h in self.workers.values() if rid in h.in_flight), None)
        for handle in self.workers.values():
            handle.in_flight.discard(rid)
            handle.drop_backlog(rid)
        lc = stream.lifecycle
        lc.finish_reason, lc.error = reason, error
        lc.advance(state, t_s)
        self.gate.finished(lc)
        # a worker keeps the sequence of a request that ran cached (not one cancelled before its prefill ended)
        if holder is not None and (state is RequestState.FINISHED
                                   or state is RequestState.CANCELLED and lc.prefill_end_s is not None):
            self.affinity.ended(holder, lc, stream.prompt_ids + tuple(stream.token_ids), self.workers)
        self.records[rid] = lc
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        if state is RequestState.FAILED:
            stream.queue.put_nowait(Event(EventKind.ERROR, rid, t_s, text=text, error=error or "failed"))
        else:
            stream.queue.put_nowait(Event(EventKind.DONE, rid, t_s, text=text, finish_reason=reason))

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
        wanted = {rid for rid in held if rid in self.streams and rid not in self.cancelling}
        intact = self.handoff.recover(handle.spec.role, pid, wanted if self.config.resume and not crash_loop else set())
        plan = recovery.plan_recovery(recovery.WorkerDeath(
            role=handle.role, pid=pid, cause=cause, is_crash_loop=crash_loop, resume=self.config.resume,
            n_ctx=self.config.n_ctx, entry_worker_failed=bool(self._entry_worker(avoid=handle).failed),
            held=tuple(self.streams[rid].held(rid in self.cancelling, rid in intact) for rid in held
                       if rid in self.streams)))
        self.worker_events.append(WorkerEvent(
            WorkerEventKind.DIED, handle.role, pid, now, exitcode=exitcode, cause=cause, crash_loop=crash_loop,
            failed_requests=tuple(rid for rid, _ in plan.fail), resumed_from_slot=plan.from_slot,
            recomputed_requests=plan.recompute))
        for rid in plan.cancel:  # the cancel died with the worker: honour it
            self.end_request(rid, RequestState.CANCELLED, now, reason=FinishReason.CANCELLED)
        for rid, error in plan.fail:
            self.end_request(rid, RequestState.FAILED, now, error=error)
        handle.last_error = None
        self.pool.unregister(pid)
        if not plan.restart:
            handle.failed = plan.failed_reason
            self.worker_events.append(WorkerEvent(WorkerEventKind.FAILED, handle.role, pid, now,
                                                  cause=plan.failed_reason or ""))
            return
        for rid in plan.from_slot:  # KV intact in its slot: the restarted decode worker imports it
            self.streams[rid].note_resume("slot")
            self.handoff.resume(rid, handle)
        for rid in plan.recompute:  # KV lost: prefill prompt + output again on the (restarted) entry worker
            stream = self.streams[rid]
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
                self.end_request(rid, RequestState.FAILED, time.monotonic(),
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
        return request_id in self.streams

    def finished_since(self, t_s: float) -> list[Lifecycle]:
        """The requests that ended after ``t_s`` (monotonic), oldest first (of the last MAX_RECORDS)."""
        newer = itertools.takewhile(lambda lc: lc.ended_s is None or lc.ended_s > t_s, reversed(self.records.values()))
        return list(newer)[::-1]

    def steps_since(self, t_s: float = float("-inf")) -> list[StepRecord]:
        """The steps that ended at or after ``t_s`` (monotonic), in the order they arrived (of the last
        ``step_log_len`` kept)."""
        # why a full scan, not from the end back: two workers' steps arrive out of end-time order
        return [step for step in self.step_log if step.t_end_s >= t_s]

    def last_steps(self, n: int) -> list[StepRecord]:
        return list(self.step_log)[-n:]

    def n_streaming(self) -> int:
        """Running requests that have their first token."""
        return sum(1 for stream in self.streams.values() if stream.token_ids)

    def kv_peak(self, t0_s: float, t1_s: float) -> tuple[int, int]:
        """(peak arena bytes in use, KV bytes in transit then) between two monotonic times; (0, 0): no arena."""
        return self.handoff.peak_usage(t0_s, t1_s)

    def cache_stats(self) -> dict[str, PrefixCacheStats]:
        """Worker name -> its prefix cache's latest stats (workers without a cache are left out)."""
        return {name: h.cache_stats for name, h in self.workers.items() if h.cache_stats is not None}

    def worker_pid(self, name: str) -> int | None:
        return self.workers[name].pid

    def step_estimate(self, name: str) -> StepEstimate | None:
        """The step-time estimate worker ``name`` last published, once trusted (``AdmissionGate.estimate``)."""
        return self.gate.estimate(name)

    def snapshot(self) -> EngineSnapshot:
        """A picture of the engine: workers, queues, the KV arena, running requests, recent worker events."""
        by_state: dict[str, list[str]] = {}
        for rid, stream in self.streams.items():
            by_state.setdefault(stream.lifecycle.state.value, []).append(rid)
        by_class = dict(Counter(st.lifecycle.request_class for st in self.streams.values()))
        return EngineSnapshot(
            mode=self.config.mode, model=self.model_path, n_ctx=self.config.n_ctx, chunk=self.config.chunk,
            workers=tuple(h.snapshot() for h in self.workers.values()),
            kv_arena=self.handoff.snapshot(),
            requests={state: tuple(ids) for state, ids in by_state.items()}, n_steps=len(self.step_log),
            requests_by_class=by_class, worker_events=tuple(self.worker_events), t_s=time.monotonic(),
            memory=self.memory, admission=self.gate.snapshot(self._load(self.streams), by_class),
            cache=self.cache_stats())

    def measure_memory(self) -> MemoryBreakdown:
        """Measure every homepd process now (controller, workers, KV arena) by what holds the memory; also kept
        as ``snapshot().memory``.  Reads /proc (a few ms): call it off the event loop when serving."""
        self.memory = self.pool.measure_memory(self.model_path)
        return self.memory
