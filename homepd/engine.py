"""The controller: starts workers, admits and routes requests, streams tokens back.

Used by every face (service, dashboard, benchmarks).  Runs on an asyncio loop;
one reader thread per worker turns pipe messages into loop callbacks, so a
worker's death (pipe EOF) is noticed at once.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from homepd.chat import render_chat
from homepd.config import EngineConfig
from homepd.errors import EngineError, RequestError
from homepd.kvslot_header import SlotState
from homepd.messages import (AttachSlots, CancelRequest, KVHandoff, KVImported, RequestDone, SlotFreed, StepRecord,
                             StepReport, SubmitRequest, WorkerFatal, WorkerReady)
from homepd.request import Lifecycle, RequestState
from homepd.sampling import SamplingParams
from homepd.workers import WorkerHandle

MAX_RECORDS = 10_000
SLOT_SLACK_BYTES = 1 << 20
KV_BYTES_PER_TOKEN_GUESS = 64 << 10  # placement plan's memory check when the GGUF header does not say
MAX_STEP_LOG = 100_000
_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """One streamed event: a token, the end of the request, or an error (always last)."""
    kind: str  # "token" | "done" | "error"
    request_id: str
    t_s: float
    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """Async iterator over a request's events; ends after its 'done' or 'error' event."""

    def __init__(self, request_id: str, lifecycle: Lifecycle):
        self.request_id = request_id
        self.lifecycle = lifecycle
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        event = await self.queue.get()
        self._ended = event.kind != "token"
        return event

    async def collect(self) -> tuple[list[Event], str]:
        """Drain the stream: (all events, concatenated text)."""
        events = [e async for e in self]
        return events, "".join(e.text for e in events)


class Engine:
    def __init__(self, config: EngineConfig, sampler=None):
        """``sampler``: an optional running ``homepd.sampler.Sampler``; worker pids are registered with it."""
        self.config = config.validated()
        self.sampler = sampler
        self.model_path: str | None = None
        self.tokenizer = None
        self.records: OrderedDict[str, Lifecycle] = OrderedDict()
        self.streams: dict[str, RequestStream] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=MAX_STEP_LOG)
        self.worker_events: list[dict] = []  # deaths and restarts, for recovery metrics
        self.workers: dict[str, WorkerHandle] = {}
        self.pool = None                           # KV slot pool (disaggregated), owned here
        self.in_slot: dict[str, KVHandoff] = {}    # handed off, KV in a slot, not yet imported
        self.cancelling: set[str] = set()
        self.placement: dict[str, dict] = {}
        self.model_fingerprint = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # lifecycle of the engine -----------------------------------------------------
    async def start(self) -> None:
        from homepd.kvslot_segment import cleanup_stale_segments
        from homepd.llm import LlamaModel
        from homepd.models import fingerprint, resolve_model

        self._loop = asyncio.get_running_loop()
        self.model_path = str(await asyncio.to_thread(resolve_model, self.config.model, self.config.models_dir))
        self.model_fingerprint = await asyncio.to_thread(fingerprint, self.model_path)
        self.tokenizer = await asyncio.to_thread(LlamaModel, self.model_path, 0, True)
        roles = ["colocated"] if self.config.mode == "colocated" else ["prefill", "decode"]
        if self.config.mode == "disaggregated":
            await asyncio.to_thread(cleanup_stale_segments)  # segments of dead controllers
        self.placement = self._placements(roles)
        for role in roles:
            self.workers[role] = WorkerHandle(role, self._spec_for(role), self._loop, self._on_message,
                                              self._on_exit)
        try:
            await asyncio.gather(*(h.start() for h in self.workers.values()))
            for handle in self.workers.values():
                self._register(handle)
            if self.config.mode == "disaggregated":
                self._create_slots()
        except BaseException:
            await self.stop()
            raise

    def _placements(self, roles: list[str]) -> dict[str, dict]:
        """Where each worker runs: config overrides, else (disaggregated) the placement plan."""
        c = self.config
        if c.mode == "colocated":
            return {"colocated": {"cpu_cores": c.cpu_cores, "n_threads": c.effective_n_threads,
                                  "gpu": None if c.gpu_index is None else str(c.gpu_index),
                                  "n_gpu_layers": c.n_gpu_layers}}
        from homepd.placement import plan_placement
        from homepd.probe import probe

        from homepd.gguf import read_gguf_header

        header = read_gguf_header(self.model_path)
        per_token = header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS
        plan = plan_placement(probe(), model_bytes=header.size_bytes, kv_bytes=c.n_ctx * per_token).disaggregated
        overrides = {"prefill": (c.prefill_cores, c.prefill_threads), "decode": (c.decode_cores, c.decode_threads)}
        if not plan.feasible and not all(cores for cores, _ in overrides.values()):
            raise EngineError(f"disaggregated serving is not feasible on this box: {plan.reason}")
        out = {}
        for role in roles:
            cores, threads = overrides[role]
            if cores:  # placed by hand: on the CPU, on these cores
                out[role] = {"cpu_cores": tuple(cores), "n_threads": threads or len(cores), "gpu": None,
                             "n_gpu_layers": 0}
            else:
                planned = getattr(plan, role)
                out[role] = {"cpu_cores": planned.cpu_cores or None, "n_threads": threads or planned.n_threads,
                             "gpu": planned.cuda_visible_devices or None, "n_gpu_layers": planned.n_gpu_layers}
        return out

    def _register(self, handle: WorkerHandle) -> None:
        if self.sampler is not None and handle.pid is not None:
            self.sampler.register_process(handle.pid, handle.role)

    def _spec_for(self, role: str):
        from homepd.worker import WorkerSpec
        c, place = self.config, self.placement[role]
        n_gpu_layers = place["n_gpu_layers"]
        return WorkerSpec(role=role, model_path=self.model_path, n_ctx=c.n_ctx, n_seq_max=c.n_seq_max,
                          chunk=c.chunk, n_threads=place["n_threads"], cpu_cores=place["cpu_cores"],
                          n_gpu_layers=999 if n_gpu_layers < 0 else n_gpu_layers, fault=c.fault,
                          cuda_visible_devices=place["gpu"] or "", model_fingerprint=self.model_fingerprint)

    def _create_slots(self) -> None:
        """The KV slot pool, sized from the prefill worker's measured state bytes per token."""
        from homepd.kvslots import SlotPool

        ready = self.workers["prefill"].ready
        capacity = ready.state_overhead_bytes + ready.state_bytes_per_token * self.config.n_ctx + SLOT_SLACK_BYTES
        self.pool = SlotPool.create(self.config.n_slots, capacity)
        for handle in self.workers.values():
            handle.send(AttachSlots(tuple(self.pool.names)))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*(h.stop() for h in self.workers.values()))
        for rid in list(self.streams):
            self._end(rid, RequestState.FAILED, time.monotonic(), error="engine stopped")
        if self.pool is not None:
            self.pool.close()  # the owner unlinks
            self.pool = None
        if self.tokenizer is not None:
            self.tokenizer.close()
            self.tokenizer = None

    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

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
            raise RequestError(f"prompt is {len(ids)} tokens; the context holds {self.config.n_ctx} "
                               f"(n_ctx) including at least one generated token — shorten it or raise n_ctx")
        return ids

    async def submit(self, prompt: str | None = None, *, messages: list | None = None,
                     params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        """Admit a request; returns its event stream.  Raises RequestError before any worker sees it."""
        params = (params or SamplingParams()).validated()
        ids = self.prepare(prompt, messages)
        room = self.config.n_ctx - len(ids) + 1
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)  # ends with finish_reason 'length'
        rid = request_id or f"req-{os.getpid()}-{next(_ids)}"
        if rid in self.streams:
            raise RequestError(f"request id {rid!r} is already running")
        lifecycle = Lifecycle(request_id=rid, arrived_s=time.monotonic(), n_prompt_tokens=len(ids))
        self.records[rid] = lifecycle
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)
        stream = RequestStream(rid, lifecycle)
        self.streams[rid] = stream
        self._entry_worker().send_request(rid, SubmitRequest(rid, tuple(ids), params))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request; True if it was running."""
        if request_id not in self.streams:
            return False
        self.cancelling.add(request_id)
        for handle in self.workers.values():
            if request_id in handle.in_flight:
                if handle.drop_backlog(request_id):
                    self._end(request_id, RequestState.CANCELLED, time.monotonic(), reason="cancelled")
                else:
                    handle.send(CancelRequest(request_id))
        return True

    def _entry_worker(self) -> WorkerHandle:
        return self.workers["colocated" if self.config.mode == "colocated" else "prefill"]

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
        elif isinstance(msg, WorkerReady):
            pass  # the handle keeps it
        elif isinstance(msg, WorkerFatal):
            handle.last_error = msg.error.splitlines()[0] if msg.error else "unknown error"

    def _on_step(self, handle: WorkerHandle, report: StepReport) -> None:
        step = report.step
        self.step_log.append(step)
        for rid in report.prefill_started:
            if rid in self.streams:
                self.records[rid].advance(RequestState.PREFILLING, step.t_start_s)
        after_prefill = RequestState.TRANSFERRING if handle.role == "prefill" else RequestState.DECODING
        for rid in report.prefill_ended:
            if rid in self.streams:
                self.records[rid].prefill_end_s = step.t_end_s
                self.records[rid].advance(after_prefill, step.t_end_s)
        for tok in report.tokens:
            stream = self.streams.get(tok.request_id)
            if stream is not None:
                stream.lifecycle.add_token(tok.t_s)
                stream.queue.put_nowait(Event("token", tok.request_id, tok.t_s, tok.token_id, tok.text))
        for done in report.done:
            self._on_done(done)

    def _on_handoff(self, msg: KVHandoff) -> None:
        """Prefill worker exported a request's KV into a slot: route it to the decode worker."""
        rid = msg.request_id
        self.workers["prefill"].in_flight.discard(rid)
        if rid not in self.streams or rid in self.cancelling:
            self.pool.reset_stale(msg.slot)  # nobody wants it any more
            self.workers["prefill"].send(SlotFreed(msg.slot))
            self._end(rid, RequestState.CANCELLED, time.monotonic(), reason="cancelled")
            return
        lc = self.records[rid]
        lc.kv_bytes, lc.kv_slot_wait_s = msg.n_bytes, msg.slot_wait_s
        lc.kv_export_s = msg.export_end_s - msg.export_start_s
        self.in_slot[rid] = msg
        self.workers["decode"].send_request(rid, msg)

    def _on_imported(self, msg: KVImported) -> None:
        self.in_slot.pop(msg.request_id, None)
        self.workers["prefill"].send(SlotFreed(msg.slot))
        lc = self.records.get(msg.request_id)
        if lc is not None and msg.request_id in self.streams:
            lc.kv_import_s = msg.import_end_s - msg.import_start_s
            lc.transfer_end_s = msg.import_end_s
            lc.advance(RequestState.DECODING, msg.import_end_s)

    def _on_done(self, done: RequestDone) -> None:
        state = {"cancelled": RequestState.CANCELLED, "error": RequestState.FAILED}.get(done.reason,
                                                                                      RequestState.FINISHED)
        self._end(done.request_id, state, done.t_s, reason=done.reason, text=done.text, error=done.error)

    def _end(self, rid: str, state: RequestState, t_s: float, reason: str | None = None, text: str = "",
             error: str | None = None) -> None:
        stream = self.streams.pop(rid, None)
        self.cancelling.discard(rid)
        if self.in_slot.pop(rid, None) is not None:  # its slot was freed by the decode worker
            self.workers["prefill"].send(SlotFreed(-1))
        if stream is None:
            return
        for handle in self.workers.values():
            handle.in_flight.discard(rid)
        lc = stream.lifecycle
        lc.finish_reason, lc.error = reason, error
        lc.advance(state, t_s)
        if state is RequestState.FAILED:
            stream.queue.put_nowait(Event("error", rid, t_s, text=text, error=error or "failed"))
        else:
            stream.queue.put_nowait(Event("done", rid, t_s, text=text, finish_reason=reason))

    def _on_exit(self, handle: WorkerHandle, exitcode: int | None) -> None:
        """A worker process ended.  Fail what it held, then restart it (unless stopping)."""
        if self._stopping:
            return
        now = time.monotonic()
        cause = f"exit code {exitcode}" + (f": {handle.last_error}" if handle.last_error else "")
        resumable = self._recover_slots(handle)
        lost = sorted(handle.in_flight - set(resumable))
        self.worker_events.append({"role": handle.role, "pid": handle.pid, "died_s": now, "exitcode": exitcode,
                                   "failed_requests": lost, "resumed_requests": sorted(resumable)})
        for rid in lost:
            self._end(rid, RequestState.FAILED, now,
                      error=f"{handle.role} worker (pid {handle.pid}) died ({cause}); request failed — retry it")
        handle.last_error = None
        if self.sampler is not None:
            self.sampler.unregister_process(handle.pid)
        handle.in_flight.clear()
        handle.backlog.clear()
        for rid in resumable:  # KV still in its slot: the restarted decode worker imports it, no new prefill
            handle.send_request(rid, self.in_slot[rid])
        asyncio.ensure_future(self._restart(handle))

    def _recover_slots(self, handle: WorkerHandle) -> list[str]:
        """Put the dead worker's slots back in order; return requests whose KV is still in a slot."""
        if self.pool is None:
            return []
        for slot in self.pool.slots_held_by(handle.pid):
            state = self.pool.state(slot).name
            if handle.role == "decode" and state == "READING":
                self.pool.reset_stale(slot, to=SlotState.READY)  # intact: re-import it
            elif state in ("WRITING", "READING"):
                self.pool.reset_stale(slot)
        if handle.role != "decode":
            return []
        return [rid for rid in sorted(handle.in_flight) if rid in self.in_slot and rid in self.streams]

    async def _restart(self, handle: WorkerHandle) -> None:
        try:
            await handle.start()
        except Exception as exc:  # could not come back: fail what waits for it
            for rid in sorted(handle.in_flight):
                self._end(rid, RequestState.FAILED, time.monotonic(), error=f"{handle.role} worker restart failed: {exc}")
            return
        self._register(handle)
        if self.pool is not None:
            handle.send(AttachSlots(tuple(self.pool.names)))
            if handle.role == "prefill":
                handle.send(SlotFreed(-1))  # wake it: slots may have freed while it was down
        self.worker_events.append({"role": handle.role, "pid": handle.pid, "restarted_s": time.monotonic()})

    # state -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """A plain-data picture of the engine: workers, queues, running requests."""
        by_state: dict[str, list[str]] = {}
        for rid, stream in self.streams.items():
            by_state.setdefault(stream.lifecycle.state.value, []).append(rid)
        return {
            "mode": self.config.mode,
            "model": self.model_path,
            "n_ctx": self.config.n_ctx,
            "chunk": self.config.chunk,
            "workers": [h.describe() for h in self.workers.values()],
            "kv_slots": None if self.pool is None else {
                "n_slots": len(self.pool), "capacity_bytes": self.pool.capacity_bytes,
                "occupancy": self.pool.occupancy(), "in_slot": sorted(self.in_slot)},
            "requests": by_state,
            "n_steps": len(self.step_log),
            "worker_events": list(self.worker_events),
        }
