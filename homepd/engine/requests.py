"""The request table: the running requests (their streams), the finished ones (their lifecycles), the cancels on
their way, and the step log; and the one place each of them changes.

The controller adds a request it admitted (``add``) and hands the table what its workers report about requests
(``step``, ``done``, ``preempted``, ``reused``).  A request ends here (``end``), whoever ends it: its worker, a
cancel, recovery, or the mode's handoff (``homepd.engine.topology.handoff``, to which the table is its
``Requests``).  Ending a request frees what it held on the workers and in the handoff, tells the gate and the
prefix affinity how it went, records its lifecycle and gives its stream its last event.  The controller's read
API answers from here (``finished_since``, ``steps_since``, ``n_streaming``...).
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict, deque
from dataclasses import replace
from typing import Iterable, Mapping

from homepd.core.lifecycle import Lifecycle, RequestState, end_state
from homepd.core.modes import Role
from homepd.core.protocol import CancelRequest, KVPreempted, PrefixReused, RequestDone, StepRecord, StepReport
from homepd.core.records import FinishReason
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import AdmissionGate, WorkerLoad, load_of
from homepd.engine.handles import WorkerHandle
from homepd.engine.recovery import HeldRequest
from homepd.engine.streams import Event, EventKind, RequestStream
from homepd.engine.topology.handoff import NoHandoff

# finished request records kept for finished_since (the app's embedded source reads them every tick; the
# service's consumers are told at the end); each holds its token times: 10,000 grew the controller by ~20 MB
MAX_RECORDS = 1_000
# the step log keeps the newest steps within ~32 MiB: a StepRecord measures ~450 B plus ~8 B per decode id and
# ~100 B per prefill entry (tracemalloc), so this many at worst (every sequence in both lists) fit
STEP_LOG_BYTES = 32 << 20


def step_log_len(n_seq_max: int) -> int:
    return STEP_LOG_BYTES // (512 + 128 * n_seq_max)


class RequestTable:
    def __init__(self, workers: Mapping[str, WorkerHandle], gate: AdmissionGate, affinity: PrefixAffinity,
                 n_seq_max: int):
        """``workers``: the controller's handles by name (an ended request is dropped from them); ``gate`` and
        ``affinity``: the controller's, told how each request and step went."""
        self.workers = workers
        self.gate = gate
        self.affinity = affinity
        self.handoff = NoHandoff()  # the mode's KV handoff, told of every end (the controller sets it at start)
        self.streams: dict[str, RequestStream] = {}                # running requests
        self.records: OrderedDict[str, Lifecycle] = OrderedDict()  # finished requests, newest last
        self.cancelling: set[str] = set()                          # cancels sent to a worker, not yet ended
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_len(n_seq_max))
        self.step_listeners: list = []  # called with each StepRecord once its tokens and ends are applied

    # what the controller and the handoff ask of a request ---------------------------------
    def __contains__(self, request_id: str) -> bool:
        """Whether it is running."""
        return request_id in self.streams

    def running(self, request_id: str) -> Lifecycle | None:
        """The lifecycle of a running request (None: not running)."""
        stream = self.streams.get(request_id)
        return stream.lifecycle if stream is not None else None

    def is_wanted(self, request_id: str) -> bool:
        """Running, and not being cancelled."""
        return request_id in self.streams and request_id not in self.cancelling

    def load(self, request_ids: Iterable[str], idle_cells: int = 0, kv_range: int = 0) -> WorkerLoad:
        """What these running requests (a worker's, or all) hold (``homepd.engine.gate.load_of``)."""
        return load_of((self.streams[rid].lifecycle for rid in request_ids if rid in self.streams), idle_cells,
                       kv_range)

    def worker_load(self, handle) -> WorkerLoad:
        """What a worker holds: its running requests, and the cells its cached prefixes hold and its cache's used
        range by its latest step."""
        stats = handle.cache_stats
        return self.load(handle.in_flight, stats.n_cached_cells if stats is not None else 0, handle.kv_range)

    def held(self, request_ids: Iterable[str], intact: set[str]) -> tuple[HeldRequest, ...]:
        """The running ones of ``request_ids`` as recovery sees them (``intact``: their KV waits in the arena)."""
        return tuple(self.streams[rid].held(rid in self.cancelling, rid in intact) for rid in request_ids
                     if rid in self.streams)

    # what changes them ----------------------------------------------------------------------
    def add(self, stream: RequestStream) -> None:
        assert stream.request_id not in self.streams, stream.request_id
        self.streams[stream.request_id] = stream

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request (True: it was running): taken from a backlog, it ends at once; sent to its
        worker, it ends when the worker says so (or dies)."""
        if request_id not in self.streams:
            return False
        self.cancelling.add(request_id)
        for handle in list(self.workers.values()):
            if request_id in handle.in_flight:
                if handle.drop_backlog(request_id):
                    self.end(request_id, RequestState.CANCELLED, time.monotonic(), reason=FinishReason.CANCELLED)
                else:
                    handle.send(CancelRequest(request_id))
        return True

    def moved(self, request_id: str, handle: WorkerHandle) -> None:
        """Its KV reached ``handle``'s worker, which now holds its prompt (its next turn is not prefilled anew)."""
        self.affinity.holds(handle, self.streams[request_id].prompt_ids)

    def preempted(self, msg: KVPreempted) -> None:
        """The full KV context re-queued it on its worker: its prompt (and output so far) is prefilled again."""
        lc = self.running(msg.request_id)
        if lc is not None:
            lc.n_kv_preemptions += 1
            lc.n_prefilled = 0

    def reused(self, msg: PrefixReused) -> None:
        """Its prompt starts from a cached prefix, not recomputed."""
        lc = self.running(msg.request_id)
        if lc is not None:
            lc.n_cached_tokens = msg.n_tokens

    def step(self, handle: WorkerHandle, report: StepReport) -> None:
        """A worker's step: logged and measured (the gate), then what it moved applied to the requests (prompt
        tokens prefilled, states, tokens streamed, ends); the step listeners hear of it last."""
        step = report.step
        if step.worker_role != handle.role:  # a replica: name the step after its worker
            step = replace(step, worker_role=handle.role)
        self.step_log.append(step)
        self.gate.observe(handle.role, step, report.estimate)
        if report.cache is not None:
            handle.cache_stats = report.cache
        handle.kv_range = step.kv_in_use
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
            self.done(done)
        for listener in self.step_listeners:
            listener(step)

    def done(self, msg: RequestDone) -> None:
        """It left its worker: finished, cancelled or failed there."""
        if msg.kv_full and msg.request_id in self.streams:
            self.streams[msg.request_id].lifecycle.ended_by_kv_full = True
        self.end(msg.request_id, end_state(msg.reason), msg.t_s, reason=msg.reason, text=msg.text, error=msg.error)

    def end(self, rid: str, state: RequestState, t_s: float, reason: FinishReason | None = None, text: str = "",
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

    # what the controller's read API answers with ----------------------------------------------
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

    def by_state(self) -> dict[str, tuple[str, ...]]:
        """State -> the running requests in it."""
        by_state: dict[str, list[str]] = {}
        for rid, stream in self.streams.items():
            by_state.setdefault(stream.lifecycle.state.value, []).append(rid)
        return {state: tuple(ids) for state, ids in by_state.items()}

    def by_class(self) -> dict[str, int]:
        """Request class -> running requests of that class."""
        return dict(Counter(stream.lifecycle.request_class for stream in self.streams.values()))
