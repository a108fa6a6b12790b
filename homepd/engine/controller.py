"""The controller: starts workers, admits and routes requests, streams tokens back.

Used by every face (service, dashboard, benchmarks).  Runs on an asyncio loop
that also reads every worker's pipe, so a worker's death (pipe EOF) is noticed
at once.  Disaggregation's slot bookkeeping lives in ``homepd.kv.router``; what
to do about a dead worker is decided by ``homepd.engine.recovery`` (pure) and
applied here.

# why ~520 lines: one concept, the controller's request table and the worker
# messages that move it (submit, steps, handoffs, ends, deaths, restarts).
# Splitting the death handling out would hand another object the table's
# private state — the mixin this module replaced.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from dataclasses import replace

from homepd.config import EngineConfig
from homepd.core.admission import RequestClass, Verdict
from homepd.core.lifecycle import Lifecycle, RequestState, end_state
from homepd.core.protocol import (CancelRequest, EngineSetup, Heartbeat, KVHandoff, KVImported, RequestDone, SlotFreed,
                                  StepRecord, StepReport, SubmitRequest, WorkerFatal, WorkerReady)
from homepd.core.records import EngineSnapshot, FinishReason, MemoryBreakdown, WorkerEvent, WorkerEventKind
from homepd.core.sampling import SamplingParams
from homepd.core.textstream import TextStream
from homepd.engine import recovery
from homepd.engine.gate import AdmissionGate, WorkerLoad
from homepd.engine.handles import WorkerHandle
from homepd.engine.prompt import render_chat
from homepd.engine.streams import Event, RequestStream
from homepd.errors import AdmissionRejected, EngineError, PromptTooLongError, RequestError

MAX_RECORDS = 10_000       # finished request records kept for metrics
MAX_STEP_LOG = 100_000
MAX_WORKER_EVENTS = 1_000
log = logging.getLogger("homepd.engine.controller")
_ids = itertools.count(1)


class Engine:
    def __init__(self, config: EngineConfig, setup: EngineSetup, sampler=None):
        """``setup``: the resolved model and worker placements (``homepd.launch.prepare``).
        ``sampler``: an optional running ``homepd.hw.monitor.Sampler``; worker pids are registered with it."""
        self.config = config.validated()
        self.setup = setup
        self.sampler = sampler
        self.model_path = setup.model_path
        self.model_fingerprint = setup.model_fingerprint
        self.tokenizer = None
        self.records: OrderedDict[str, Lifecycle] = OrderedDict()  # finished requests, newest last
        self.streams: dict[str, RequestStream] = {}                # running requests
        self.step_log: deque[StepRecord] = deque(maxlen=MAX_STEP_LOG)
        self.step_listeners: list = []  # called with each StepRecord once its tokens and ends are applied
        self.worker_events: deque[WorkerEvent] = deque(maxlen=MAX_WORKER_EVENTS)  # deaths and restarts
        self.workers: dict[str, WorkerHandle] = {}
        self.kv = None  # KVRouter (disaggregated)
        self.memory: MemoryBreakdown | None = None  # as last measured (measure_memory)
        self.cancelling: set[str] = set()
        self.gate = AdmissionGate(self.config)  # measures, predicts, admits and routes (two queues, two budgets)
        self._tasks: set[asyncio.Task] = set()
        self._restarting: dict[str, asyncio.Task] = {}  # worker name -> its restart in progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # lifecycle of the engine -----------------------------------------------------
    async def start(self) -> None:
        from homepd.backends import model_classes
        from homepd.engine.specs import worker_specs
        from homepd.kv.segment import cleanup_stale_segments

        self._loop = asyncio.get_running_loop()
        model_cls, _ = model_classes(self.config.backend)
        self.tokenizer = await asyncio.to_thread(model_cls, self.model_path, 0, True)
        if self.config.mode == "disaggregated":
            await asyncio.to_thread(cleanup_stale_segments)  # segments of dead controllers
        specs = worker_specs(self.config, self.setup)
        for role, spec in specs.items():
            self.workers[role] = WorkerHandle(role, spec, self._loop, self._on_message, self._on_exit)
        try:
            await asyncio.gather(*(h.start() for h in self.workers.values()))
            for handle in self.workers.values():
                self._register(handle)
            if self.config.mode == "disaggregated":
                from homepd.kv.router import KVRouter

                # the placement plan's arena (else sized from the prefill worker's measured KV state bytes)
                self.kv = KVRouter(self.setup.kv_arena_bytes, self.workers["prefill"].ready,
                                   max_extents=self.config.n_slots)
                for handle in self.workers.values():
                    handle.send(self.kv.attach_message())
            await asyncio.to_thread(self.measure_memory)
            if self.config.hang_timeout_s:
                self._spawn_task(self._watch_for_hangs())
        except BaseException:
            await self.stop()
            raise

    def _register(self, handle: WorkerHandle) -> None:
        if self.sampler is not None and handle.pid is not None:
            self.sampler.register_process(handle.pid, handle.role)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(h.stop() for h in self.workers.values()))
        if self.sampler is not None:
            for handle in self.workers.values():
                if handle.pid is not None:
                    self.sampler.unregister_process(handle.pid)
        for rid in list(self.streams):
            self._end(rid, RequestState.FAILED, time.monotonic(), error="engine stopped")
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        if self.tokenizer is not None:
            self.tokenizer.close()
            self.tokenizer = None

    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def wait_restarts(self) -> None:
        """Return once every worker restart in progress has ended (the worker is back, or marked failed)."""
        while self._restarting:
            await asyncio.gather(*self._restarting.values(), return_exceptions=True)
            self._restarting = {r: t for r, t in self._restarting.items() if not t.done()}

    def _spawn_task(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, kept referenced; its failure is logged, never lost."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("engine background task failed", exc_info=t.exception())

        task.add_done_callback(done)
        return task

    # requests ---------------------------------------------------------------------
    def prepare(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        """Render and tokenize a prompt or chat; raise RequestError if it cannot run."""
        if self.tokenizer is None:
            raise EngineError("the engine is not started")
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if messages is not None:
            t = self.tokenizer
            prompt = render_chat(t.chat_template(), messages, t.token_text(t.bos_id), t.token_text(t.eos_id))
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
        ids = self.tokenizer.tokenize(prompt, add_special=True, parse_special=True)
        if not ids:
            raise RequestError("prompt is empty after tokenization")
        if len(ids) >= self.config.n_ctx:
            raise PromptTooLongError(len(ids), self.config.n_ctx)
        return ids

    async def submit(self, prompt: str | None = None, *, messages: list | None = None,
                     params: SamplingParams | None = None, request_id: str | None = None,
                     request_class: str | None = None) -> RequestStream:
        """Admit a request; returns its event stream.  Raises RequestError before any worker sees it.

        Its clock starts here, before the chat template and the tokenizer run: TTFT is what a caller sees.
        """
        arrived_s = time.monotonic()
        try:
            klass = RequestClass.parse(request_class)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        params = (params or SamplingParams()).validated()
        ids = self.prepare(prompt, messages)
        failed = [h for h in self.workers.values() if h.failed]
        if failed and (self.config.mode != "replicas" or len(failed) == len(self.workers)):
            raise EngineError(f"the {failed[0].role} worker could not be restarted ({failed[0].failed}); "
                              "stop and start the engine")
        room = self.config.n_ctx - len(ids) + 1
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)  # ends with finish_reason 'length'
        rid = request_id or f"req-{os.getpid()}-{next(_ids)}"
        if rid in self.streams:
            raise RequestError(f"request id {rid!r} is already running")
        worker = self._route_new(len(ids))
        decision = self.gate.decide(klass, len(ids), worker.role, worker.spec, self._load(worker.in_flight))
        if decision is not None and decision.verdict is Verdict.REJECT:
            raise AdmissionRejected(f"{klass.value} request rejected early: {decision.reason}; retry after "
                                    f"{decision.retry_after_s:g} s", decision.retry_after_s, klass.value,
                                    decision.predicted_ttft_ms)
        lifecycle = Lifecycle(request_id=rid, arrived_s=arrived_s, n_prompt_tokens=len(ids),
                              request_class=klass.value,
                              predicted_ttft_s=decision.predicted_ttft_ms / 1e3 if decision else None,
                              admission=decision.verdict.value if decision else Verdict.ADMIT.value)
        stream = RequestStream(rid, lifecycle, tuple(ids), params)
        self.streams[rid] = stream
        worker.send_request(rid, SubmitRequest(rid, tuple(ids), params, request_class=klass.value,
                                               deadline_s=self._deadline(lifecycle)))
        return stream

    def _deadline(self, lc: Lifecycle) -> float:
        return lc.arrived_s + self.gate.budgets[RequestClass(lc.request_class)].ttft_ms / 1e3

    def _route_new(self, n_tokens: int) -> WorkerHandle:
        """The entry worker of a new request; in disaggregated mode a prompt that fits the prefill worker is
        still prefilled on the decode worker when the gate predicts that is sooner (short prompts)."""
        worker = self._entry_worker(n_tokens=n_tokens)
        if worker.role == "prefill" and self.config.local_prefill:
            prefill, decode = self.workers["prefill"], self.workers["decode"]
            if not decode.failed and self.gate.route(n_tokens, prefill.spec, self._load(prefill.in_flight),
                                                     decode.spec, self._load(decode.in_flight)):
                return decode
        return worker

    def _load(self, request_ids) -> WorkerLoad:
        """What these running requests (a worker's, or all) hold: prompt tokens still to prefill and requests
        waiting for a first token, per class, and the decoding streams."""
        tokens: Counter = Counter()
        queued: Counter = Counter()
        n_decode = n_interactive = 0
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is None:
                continue
            lc = stream.lifecycle
            klass = RequestClass(lc.request_class)
            if lc.first_token_s is None:
                tokens[klass] += max(0, lc.n_prompt_tokens - lc.n_prefilled)
                queued[klass] += 1
            else:
                n_decode += 1
                n_interactive += klass is RequestClass.INTERACTIVE
        return WorkerLoad(dict(tokens), dict(queued), n_decode, n_interactive)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request; True if it was running.  Its stream ends with finish_reason 'cancelled'."""
        if request_id not in self.streams:
            return False
        self.cancelling.add(request_id)
        for handle in list(self.workers.values()):
            if request_id in handle.in_flight:
                if handle.drop_backlog(request_id):
                    self._end(request_id, RequestState.CANCELLED, time.monotonic(), reason=FinishReason.CANCELLED)
                else:
                    handle.send(CancelRequest(request_id))
        return True

    def lifecycle(self, request_id: str) -> Lifecycle | None:
        """The lifecycle of a running or recently finished request."""
        stream = self.streams.get(request_id)
        return stream.lifecycle if stream is not None else self.records.get(request_id)

    def _entry_worker(self, avoid: WorkerHandle | None = None, n_tokens: int = 0) -> WorkerHandle:
        """Where a new (or recomputed) request of ``n_tokens`` goes: the colocated or prefill worker (the
        decode worker when its KV fits the prefill worker's context or the arena not: ``KVRouter.route``),
        or the least loaded replica that has not failed (``avoid``: a replica that just died, if another
        can take it)."""
        if self.config.mode == "disaggregated" and self.kv is not None:
            return self.workers[self.kv.route(n_tokens)]
        if self.config.mode != "replicas":
            return self.workers["colocated" if self.config.mode == "colocated" else "prefill"]
        usable = [h for h in self.workers.values() if not h.failed and h is not avoid] or \
                 [h for h in self.workers.values() if not h.failed] or list(self.workers.values())
        return min(usable, key=lambda h: (len(h.in_flight) + (0 if h.ready else 1), h.role))

    # messages from workers (on the loop thread) -------------------------------------
    def _on_message(self, handle: WorkerHandle, msg) -> None:
        if isinstance(msg, StepReport):
            self._on_step(handle, msg)
        elif isinstance(msg, RequestDone):
            self._on_done(msg)
        elif isinstance(msg, KVHandoff):
            self._on_handoff(msg)
        elif isinstance(msg, KVImported):
            self._on_imported(msg)
        elif isinstance(msg, (WorkerReady, Heartbeat)):
            pass  # the handle keeps the first; the second only proves it alive
        elif isinstance(msg, WorkerFatal):
            handle.last_error = msg.error.splitlines()[0] if msg.error else "unknown error"

    def _on_step(self, handle: WorkerHandle, report: StepReport) -> None:
        step = report.step
        if step.worker_role != handle.role:  # a replica: name the step after its worker
            step = replace(step, worker_role=handle.role)
        self.step_log.append(step)
        self.gate.observe(handle.role, step, report.estimate)
        for rid, n in step.prefill:
            if rid in self.streams:
                self.streams[rid].lifecycle.n_prefilled += n
        for rid in report.prefill_started:
            if rid in self.streams:
                self.streams[rid].lifecycle.advance(RequestState.PREFILLING, step.t_start_s)
        after_prefill = RequestState.TRANSFERRING if handle.role == "prefill" else RequestState.DECODING
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
                stream.queue.put_nowait(Event("token", tok.request_id, tok.t_s, tok.token_id, tok.text))
        for done in report.done:
            self._on_done(done)
        for listener in self.step_listeners:
            listener(step)

    def _on_handoff(self, msg: KVHandoff) -> None:
        """Prefill worker exported a request's KV into a slot: route it to the decode worker."""
        rid = msg.request_id
        self.workers["prefill"].in_flight.discard(rid)
        if rid not in self.streams or rid in self.cancelling:
            self.kv.discard_export(msg)  # nobody wants it any more
            self.workers["prefill"].send(SlotFreed(msg.slot))
            self._end(rid, RequestState.CANCELLED, time.monotonic(), reason=FinishReason.CANCELLED)
            return
        lc = self.streams[rid].lifecycle
        lc.kv_bytes, lc.kv_slot_wait_s = msg.n_bytes, msg.slot_wait_s
        lc.kv_export_s = msg.export_end_s - msg.export_start_s
        self.kv.handed_off(msg)
        decode = self.workers["decode"]
        if decode.failed:
            self._end(rid, RequestState.FAILED, time.monotonic(), error=f"decode worker is down ({decode.failed})")
        else:
            decode.send_request(rid, msg)

    def _on_imported(self, msg: KVImported) -> None:
        self.kv.imported(msg.request_id)
        self.workers["prefill"].send(SlotFreed(msg.slot))
        stream = self.streams.get(msg.request_id)
        if stream is not None:
            lc = stream.lifecycle
            lc.kv_import_s = msg.import_end_s - msg.import_start_s
            lc.transfer_end_s = msg.import_end_s
            lc.advance(RequestState.DECODING, msg.import_end_s)

    def _on_done(self, done: RequestDone) -> None:
        self._end(done.request_id, end_state(done.reason), done.t_s, reason=done.reason, text=done.text,
                  error=done.error)

    def _end(self, rid: str, state: RequestState, t_s: float, reason: FinishReason | None = None, text: str = "",
             error: str | None = None) -> None:
        """The one place a request ends: its stream gets its last event, its resources are freed."""
        stream = self.streams.pop(rid, None)
        self.cancelling.discard(rid)
        if self.kv is not None and self.kv.drop(rid):
            self.workers["prefill"].send(SlotFreed(-1))  # a slot may be free again
        if stream is None:
            return
        for handle in self.workers.values():
            handle.in_flight.discard(rid)
            handle.drop_backlog(rid)
        lc = stream.lifecycle
        lc.finish_reason, lc.error = reason, error
        lc.advance(state, t_s)
        self.gate.finished(lc)
        self.records[rid] = lc
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        if state is RequestState.FAILED:
            stream.queue.put_nowait(Event("error", rid, t_s, text=text, error=error or "failed"))
        else:
            stream.queue.put_nowait(Event("done", rid, t_s, text=text, finish_reason=reason))

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
        handle.backlog.clear()
        wanted = {rid for rid in held if rid in self.streams and rid not in self.cancelling}
        intact: set[str] = set()
        if self.kv is not None:
            intact = set(self.kv.recover(handle.role, pid, wanted if self.config.resume and not crash_loop else set()))
            self.workers["prefill"].send(SlotFreed(-1))  # recovery may have freed slots
        plan = recovery.plan_recovery(recovery.WorkerDeath(
            role=handle.role, pid=pid, cause=cause, is_crash_loop=crash_loop, resume=self.config.resume,
            n_ctx=self.config.n_ctx, entry_worker_failed=bool(self._entry_worker(avoid=handle).failed),
            held=tuple(self._held(rid, rid in intact) for rid in held if rid in self.streams)))
        self.worker_events.append(WorkerEvent(
            WorkerEventKind.DIED, handle.role, pid, now, exitcode=exitcode, cause=cause, crash_loop=crash_loop,
            failed_requests=tuple(rid for rid, _ in plan.fail), resumed_from_slot=plan.from_slot,
            recomputed_requests=plan.recompute))
        for rid in plan.cancel:  # the cancel died with the worker: honour it
            self._end(rid, RequestState.CANCELLED, now, reason=FinishReason.CANCELLED)
        for rid, error in plan.fail:
            self._end(rid, RequestState.FAILED, now, error=error)
        handle.last_error = None
        if self.sampler is not None:
            self.sampler.unregister_process(pid)
        if not plan.restart:
            handle.failed = plan.failed_reason
            self.worker_events.append(WorkerEvent(WorkerEventKind.FAILED, handle.role, pid, now,
                                                  cause=plan.failed_reason or ""))
            return
        for rid in plan.from_slot:  # KV intact in its slot: the restarted decode worker imports it
            self._note_resume(rid, "slot")
            handle.send_request(rid, self.kv.in_arena[rid])
        for rid in plan.recompute:  # KV lost: prefill prompt + output again on the (restarted) entry worker
            self._note_resume(rid, "recompute")
            request = self._recompute_request(rid)
            self._entry_worker(avoid=handle, n_tokens=len(request.prompt_ids)).send_request(rid, request)
        self._restarting[handle.role] = self._spawn_task(self._restart(handle, died_s=now))

    def _held(self, rid: str, in_intact_slot: bool) -> recovery.HeldRequest:
        stream = self.streams[rid]
        return recovery.HeldRequest(
            request_id=rid, n_prompt=len(stream.prompt_ids), n_output=len(stream.token_ids),
            max_tokens=stream.params.max_tokens, n_resumes=stream.lifecycle.n_resumes,
            is_cancelling=rid in self.cancelling, in_intact_slot=in_intact_slot)

    def _note_resume(self, rid: str, how: str) -> None:
        lc = self.streams[rid].lifecycle
        lc.n_resumes += 1
        lc.resumed_by.append(how)

    def _recompute_request(self, rid: str) -> SubmitRequest:
        """The request again, its output so far appended to the prompt, with the text stream rebuilt."""
        stream = self.streams[rid]
        text = TextStream(stream.params.stop)
        for token in stream.token_ids:
            text.feed(self.tokenizer.token_to_piece(token))
        params = replace(stream.params, max_tokens=stream.params.max_tokens - len(stream.token_ids))
        if self.kv is not None:
            self.kv.drop(rid)  # a stale slot entry must not be imported later
        stream.lifecycle.n_prefilled = 0
        return SubmitRequest(rid, stream.prompt_ids + tuple(stream.token_ids), params, stream=text,
                             request_class=stream.lifecycle.request_class, deadline_s=self._deadline(stream.lifecycle))

    async def _restart(self, handle: WorkerHandle, died_s: float) -> None:
        error = None
        for attempt in range(recovery.RESTART_ATTEMPTS):
            try:
                await handle.start()
                break
            except Exception as exc:
                error = exc
                await asyncio.sleep(recovery.RESTART_BACKOFF_S * 2 ** attempt)
        else:  # could not come back: fail what waits for it, refuse new work
            handle.failed = f"{error}"
            self.worker_events.append(WorkerEvent(WorkerEventKind.FAILED, handle.role, None, time.monotonic(),
                                                  cause=f"could not be restarted: {error}"))
            for rid in sorted(handle.in_flight):
                self._end(rid, RequestState.FAILED, time.monotonic(),
                          error=f"{handle.role} worker could not be restarted: {error}")
            return
        self._register(handle)
        if self.kv is not None:
            handle.send(self.kv.attach_message())
            if handle.role == "prefill":
                handle.send(SlotFreed(-1))  # wake it: slots may have freed while it was down
        now = time.monotonic()
        self.worker_events.append(WorkerEvent(WorkerEventKind.RESTARTED, handle.role, handle.pid, now,
                                              recovery_s=now - died_s))

    async def _watch_for_hangs(self) -> None:
        """Every second: kill a worker that holds requests but has said nothing for hang_timeout_s."""
        timeout_s = self.config.hang_timeout_s
        while not self._stopping:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for handle in self.workers.values():
                if handle.is_hung(now, timeout_s):
                    handle.kill_hung(now - handle.last_heard_s)

    # state -----------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """A picture of the engine: workers, queues, the KV arena, running requests, recent worker events."""
        by_state: dict[str, list[str]] = {}
        for rid, stream in self.streams.items():
            by_state.setdefault(stream.lifecycle.state.value, []).append(rid)
        by_class = dict(Counter(st.lifecycle.request_class for st in self.streams.values()))
        return EngineSnapshot(
            mode=self.config.mode, model=self.model_path, n_ctx=self.config.n_ctx, chunk=self.config.chunk,
            workers=tuple(h.snapshot() for h in self.workers.values()),
            kv_arena=self.kv.snapshot() if self.kv is not None else None,
            requests={state: tuple(ids) for state, ids in by_state.items()}, n_steps=len(self.step_log),
            requests_by_class=by_class, worker_events=tuple(self.worker_events), t_s=time.monotonic(),
            memory=self.memory, admission=self.gate.snapshot(self._load(self.streams), by_class))

    def measure_memory(self) -> MemoryBreakdown:
        """Measure every homepd process now (controller, workers, KV arena) by what holds the memory; also kept
        as ``snapshot().memory``.  Reads /proc (a few ms): call it off the event loop when serving."""
        from homepd.hw.smaps import ProcessRegions, measure_processes

        processes = [ProcessRegions("controller", os.getpid())] + [
            ProcessRegions(h.role, h.pid, h.ready.memory_regions, h.ready.kv_cache_bytes)
            for h in list(self.workers.values()) if h.ready is not None and h.pid is not None]
        self.memory = measure_processes(processes, self.model_path)
        return self.memory
