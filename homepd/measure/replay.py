"""Replaying an arrival trace on a running engine, and the run record that comes out of it.

Each request is submitted at its arrival offset (real time) and drained; the
turns of a conversation (a ``chat`` trace) are sent one after another, each
its think time after the previous one ended; the
lifecycles, the step log, the worker events and the sampler's memory/energy
readings make a ``RunRecord``, from which every figure is derived
(``homepd.measure.metrics``, ``homepd.measure.stalls``).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.records import MemoryBreakdown, WorkerEvent, to_plain
from homepd.core.sampling import SamplingParams
from homepd.core.admission import AdmissionRejected
from homepd.core.terms import RequestClass
from homepd.hw.monitor import energy_by_source_j
from homepd.measure.metrics import SLO, RunSummary, summarize
from homepd.measure.stalls import Stall, attribute_stalls
from homepd.measure.trace.conversations import conversations

MAX_STALLS_KEPT = 50


@dataclass(frozen=True)
class ProcessMemory:
    """Peak memory of one homepd process during a run (bytes; None = not readable here)."""
    role: str
    rss_bytes: int | None
    pss_bytes: int | None
    uss_bytes: int | None


@dataclass(frozen=True)
class RunRecord:
    """Everything one trace replay produced: figures, evidence and the raw lifecycles."""
    mode: str
    config: dict
    trace_name: str
    summary: RunSummary
    stalls: tuple[Stall, ...]
    worker_events: tuple[WorkerEvent, ...]
    memory: tuple[ProcessMemory, ...]
    kv_arena_bytes: int                 # the KV arena's size (0: colocated)
    energy_j: dict[str, float | None]
    requests: tuple[Lifecycle, ...] = field(repr=False, default=())
    memory_breakdown: MemoryBreakdown | None = None  # at the end of the run, by what holds the memory
    arena_peak_bytes: int = 0           # most arena bytes in use at once during the run
    arena_peak_kv_bytes: int = 0        # KV payload bytes in transit at that moment

    @property
    def total_pss_bytes(self) -> int | None:
        """Peak PSS summed over every homepd process (shared pages, the KV arena included, split between
        the processes that map them: counted once unless a process outside homepd maps them too)."""
        values = [m.pss_bytes for m in self.memory]
        return None if not values or None in values else sum(values)

    def to_dict(self) -> dict:
        out = to_plain({k: getattr(self, k) for k in ("mode", "config", "trace_name", "summary", "stalls",
                                                     "worker_events", "memory", "kv_arena_bytes", "energy_j",
                                                     "arena_peak_bytes", "arena_peak_kv_bytes")})
        out["memory_breakdown"] = self.memory_breakdown.to_dict() if self.memory_breakdown else None
        out["summary"]["slo_attainment"] = self.summary.slo_attainment
        out["summary"]["n_computed_prompt_tokens"] = self.summary.n_computed_prompt_tokens
        out["summary"]["cached_prompt_share"] = self.summary.cached_prompt_share
        out["total_pss_bytes"] = self.total_pss_bytes
        out["kv_slot_bytes"] = self.kv_arena_bytes  # kv_arena_bytes's old name, for readers of older records
        out["requests"] = [r.to_dict() for r in self.requests]
        return out


class Clock(Protocol):
    """When the replayer submits: ``now()`` in seconds, and a wait until a moment of that clock."""

    def now(self) -> float: ...

    async def sleep_until(self, t_s: float) -> None: ...


class MonotonicClock:
    """Real time: ``time.monotonic()``, the engine's own clock."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, t_s: float) -> None:
        await asyncio.sleep(max(0.0, t_s - time.monotonic()))


async def replay(engine, trace, on_done=None, clock: Clock | None = None, stop_when=None) -> list[Lifecycle]:
    """Replay ``trace`` (a ``Trace`` or any sequence of trace requests); return the lifecycles in trace order.

    ``stop_when(ended, running)`` (lifecycles), asked as each request ends: True stops the replay there — the
    requests still running are cancelled and the rest never sent (left out of the result: a capacity probe
    whose outcome is already decided).

    Open loop: each request is submitted at its arrival offset on ``clock`` (default: real time).  Closed
    loop (``trace.concurrency`` = N): N requests in flight, the next submitted as one finishes, in trace
    order; arrival offsets are ignored.  A conversation's turns (``conversation``/``turn``) are one unit:
    closed within it — its first turn at its offset (or when a lane takes it), each later turn its
    ``think_s`` after the previous turn ended, with the history the trace gives it (answers at their trace
    lengths) — and open across conversations (in a closed loop, N conversations in flight).  Lifecycles
    keep the engine's clock (``time.monotonic``) whatever ``clock`` is: it decides only when requests are
    sent.
    """
    clock = clock or MonotonicClock()
    requests = list(trace)
    concurrency = getattr(trace, "concurrency", None)
    t0 = clock.now()
    running: dict[int, object] = {}    # id(stream) -> stream, while it runs
    ended: list[Lifecycle] = []
    stop = asyncio.Event()

    def check_stop() -> None:
        if stop.is_set() or stop_when is None or not stop_when(ended, [st.lifecycle for st in running.values()]):
            return
        stop.set()
        for stream in list(running.values()):
            engine.cancel(stream.request_id)

    async def wait_until(t_s: float) -> None:
        """The clock's wait, cut short by a stop."""
        if stop_when is None:
            return await clock.sleep_until(t_s)
        sleeper, stopper = asyncio.ensure_future(clock.sleep_until(t_s)), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((sleeper, stopper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, stopper):
                task.cancel()

    async def one(i, req):
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=getattr(req, "ignore_eos", False))
        klass = getattr(req, "request_class", None)
        arrived = time.monotonic()
        try:
            if getattr(req, "messages", None) is not None:
                stream = await engine.submit(messages=list(req.messages), params=params, request_class=klass)
            else:
                stream = await engine.submit(req.prompt, params=params, request_class=klass)
        except AdmissionRejected as exc:  # early rejection: a failed request in the record, not a crash
            lc = Lifecycle(request_id=f"rejected-{i}", arrived_s=arrived, request_class=klass or RequestClass.INTERACTIVE,
                           admission="reject")
            lc.error = str(exc)
            lc.advance(RequestState.FAILED, time.monotonic())
            return lc
        running[id(stream)] = stream
        try:
            await stream.collect()
        finally:
            running.pop(id(stream), None)
        if on_done:
            on_done(stream)
        ended.append(stream.lifecycle)
        check_stop()
        return stream.lifecycle

    lifecycles: list = [None] * len(requests)

    async def unit(indices: list[int], at_offset: bool):
        for k, i in enumerate(indices):
            if k:  # a later turn: its think time after the previous turn ended
                await wait_until(clock.now() + getattr(requests[i], "think_s", 0.0))
            elif at_offset:
                await wait_until(t0 + requests[i].arrival_s)
            if stop.is_set():
                return
            lifecycles[i] = await one(i, requests[i])

    units = conversations(requests)
    if not concurrency:
        await asyncio.gather(*(unit(u, True) for u in units))
        return [lc for lc in lifecycles if lc is not None]
    pending = iter(units)  # why: one iterator shared by the lanes hands out each unit once

    async def lane():
        for u in pending:
            await unit(u, False)

    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(units)))))
    return [lc for lc in lifecycles if lc is not None]


async def run_trace(engine, trace, *, trace_name: str = "", slo: SLO | None = None, sampler=None,
                    on_done=None, itl_target_ms: float | None = None, stop_when=None) -> RunRecord:
    """Replay ``trace`` on a started ``engine`` and assemble its ``RunRecord`` (``stop_when``: ``replay``)."""
    slo = slo or SLO()
    if sampler is not None:
        sampler.register_process(os.getpid(), "controller")
    events_before = len(engine.worker_events)
    t0 = time.monotonic()
    records = await replay(engine, trace, on_done, stop_when=stop_when)
    t1 = time.monotonic()
    steps = engine.steps_since(t0)
    memory, energy = (), {}
    if sampler is not None:
        sampler.sample_once()
        memory, energy = peak_memory(sampler, t0, t1), energy_by_source_j(list(sampler.history()), t0, t1)
    breakdown = await asyncio.to_thread(engine.measure_memory)
    arena_peak = engine.kv_peak(t0, t1)
    snap = engine.snapshot()
    target = itl_target_ms if itl_target_ms is not None else (slo.itl_ms or engine.config.itl_budget_ms)
    return RunRecord(
        mode=engine.config.mode, config=to_plain(engine.config), trace_name=trace_name,
        summary=summarize(records, steps, slo),
        stalls=tuple(attribute_stalls(records, steps, target)[:MAX_STALLS_KEPT]),
        worker_events=tuple(list(engine.worker_events)[events_before:]), memory=memory,
        kv_arena_bytes=snap.kv_arena.capacity_bytes if snap.kv_arena else 0, energy_j=energy,
        requests=tuple(records), memory_breakdown=breakdown, arena_peak_bytes=arena_peak[0],
        arena_peak_kv_bytes=arena_peak[1])


def peak_memory(sampler, t0_s: float, t1_s: float) -> tuple[ProcessMemory, ...]:
    """Per process role, peak RSS/PSS/USS during [t0, t1] (the latest reading if none fell inside)."""
    history = [s for s in sampler.history() if t0_s <= s.t_mono_s <= t1_s] or list(sampler.history())[-1:]
    peaks: dict[str, dict[str, int | None]] = {}
    for snap in history:
        for p in snap.processes:
            w = peaks.setdefault(p.role, {"rss_bytes": None, "pss_bytes": None, "uss_bytes": None})
            for key in w:
                value = getattr(p, key)
                if value is not None and (w[key] is None or value > w[key]):
                    w[key] = value
    return tuple(ProcessMemory(role, **w) for role, w in peaks.items())
