"""Pure functions: sampler snapshots, engine snapshots, request timings and step logs -> the app's view records.

The engine's snapshot and each request's figures arrive here typed, as an
``EngineSnapshot`` and ``RequestTimings``: the embedded engine's own, or
decoded once from ``homepd serve``'s JSON (``/status``, ``/events``, the
``homepd`` object of a reply) by the remote source — so one code path serves
both sources, and a field the service renamed fails there instead of reading
as 0 here.  No Textual, no I/O.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

from homepd.core.lifecycle import RequestTimings
from homepd.core.records import AdmissionSnapshot, EngineSnapshot, WorkerEvent, WorkerEventKind
from homepd.measure.metrics import interference
from homepd.measure.stalls import Stall
from homepd.measure.stepstream import StepSample
from homepd.tui.records import (ArchitectureView, ArenaView, CacheView, ChartPoint, ChatStats, GpuView, HardwareView,
                                ProcessView, RequestRow, short_id)

MB = 1e6


def hardware_view(snap, box=None) -> HardwareView:
    """The hardware panel from a ``homepd.hw.monitor.Snapshot`` (None before the first sample) and the
    ``BoxProbe`` taken at start (CPU model, GPU names and PCIe links; None when not probed)."""
    gpus_probed = {g.index: g for g in (box.gpus if box is not None else ())}
    gpus = []
    for g in (snap.gpus if snap is not None else ()):
        info = gpus_probed.get(g.index)
        link = ""
        if info is not None and info.pcie_gen is not None:
            link = f"Gen{info.pcie_gen} x{info.pcie_width}"
            if info.pcie_max_gen is not None and (info.pcie_max_gen, info.pcie_max_width) != (info.pcie_gen,
                                                                                           info.pcie_width):
                link += f" (max Gen{info.pcie_max_gen} x{info.pcie_max_width})"
        gpus.append(GpuView(g.index, (info.name if info else None) or f"GPU {g.index}", g.utilization_pct,
                            g.vram_used_bytes, g.vram_total_bytes, g.power_w, g.temperature_c,
                            g.pcie_tx_bytes_s, g.pcie_rx_bytes_s, link))
    note = ""
    if not gpus:
        nvml = getattr(box, "nvml", None)
        note = "no GPU on this box" + (f" ({nvml.error})" if nvml is not None and nvml.error else "")
    processes = tuple(ProcessView(p.role, p.pid, p.cpu_pct, p.rss_bytes, p.uss_bytes)
                      for p in (snap.processes if snap is not None else ()) if p.is_alive)
    ram_used = snap.ram_used_bytes if snap is not None else None
    ram_total = None if snap is None else snap.ram_used_bytes + snap.ram_available_bytes
    cpu = box.cpu if box is not None else None
    return HardwareView(
        cpu_model=cpu.model if cpu else None,
        n_cpus=len(cpu.usable_cpus) if cpu else os.cpu_count(),
        cpu_pct=snap.cpu_pct if snap is not None else None,
        # why getattr: per-core figures are not in the sampler's Snapshot yet; shown once they are
        cpu_pct_per_core=getattr(snap, "cpu_pct_per_core", None),
        ram_used_bytes=ram_used, ram_total_bytes=ram_total, gpus=tuple(gpus), processes=processes, gpu_note=note)


def architecture_view(snap: EngineSnapshot, kv_mb_s: float | None = None, note: str = "") -> ArchitectureView:
    """The architecture panel from an engine snapshot."""
    kv = snap.kv_arena
    arena = None if kv is None else ArenaView(
        capacity_bytes=kv.capacity_bytes, used_bytes=kv.used_bytes, max_extents=kv.max_extents,
        extents={state: n for state, n in kv.occupancy.items() if state != "FREE"})
    return ArchitectureView(
        mode=snap.mode, model=os.path.basename(snap.model or "?"), chunk=snap.chunk, n_ctx=snap.n_ctx,
        workers=snap.workers, by_state={state: len(ids) for state, ids in snap.requests.items()}, kv_arena=arena,
        kv_mb_s=kv_mb_s, events=tuple(_event_text(e) for e in snap.worker_events[-3:]), note=note,
        caches=cache_views(snap.cache), kv_stream_cells=snap.kv_stream_cells, **admission_lines(snap.admission))


def cache_views(stats_by_worker: dict) -> tuple[CacheView, ...]:
    """Each worker's prefix cache (``EngineSnapshot.cache``), by worker name."""
    return tuple(CacheView(worker=name, hit_ratio=c.hit_ratio, n_hit_tokens=c.n_hit_tokens,
                           n_lookup_tokens=c.n_lookup_tokens, cached_bytes=c.cached_bytes, store_bytes=c.store_bytes,
                           n_store_entries=c.n_store_entries, mode=c.mode)
                 for name, c in sorted(stats_by_worker.items()))


def admission_lines(adm: AdmissionSnapshot | None) -> dict:
    """Two queues, two budgets as panel lines: per class what waits and what admission decided; each worker's
    latest prompt budget (the chunk chosen for its step), how far TTFT predictions were off, and routing."""
    if adm is None:
        return {}
    classes = []
    for c in adm.classes:
        itl = f" ITL ≤{c.itl_budget_ms:.0f} ms" if c.itl_budget_ms else ""
        classes.append(f"{c.request_class}: {c.queued_requests} queued ({c.queued_prompt_tokens} tok) · "
                       f"{c.running} in · admitted {c.admitted} · deferred {c.deferred} · rejected "
                       f"{c.rejected} · TTFT ≤{c.ttft_budget_ms / 1e3:g} s{itl}")
    parts = [f"{role} {n}" for role, n in sorted(adm.chunk_by_worker.items())]
    text = ("chunk " + ", ".join(parts) + (" (adaptive)" if adm.adaptive_chunk else "")) if parts else ""
    if adm.ttft_error_mean_ms is not None:
        text += f" · TTFT predicted ±{adm.ttft_error_mean_ms:.0f} ms (p90 {adm.ttft_error_p90_ms:.0f})"
    if n_grants := sum(adm.deadline_grants_by_worker.values()):
        text += f" · {n_grants} gap{'s' if n_grants > 1 else ''} granted to a deadline"
    if n_lost := sum(adm.lost_grants_by_worker.values()):
        text += f" · {n_lost} at the ceiling for a lost deadline"
    if (id_wait_s := sum(adm.id_wait_s_by_worker.values())) >= 0.05:
        text += f" · prompts waited {id_wait_s:.1f} s for a sequence id"
    if adm.routed_local or adm.routed_remote:
        text += f" · routed local {adm.routed_local} / remote {adm.routed_remote}"
    return {"classes": tuple(classes), "budgets": text.lstrip(" ·")}


def _event_text(e: WorkerEvent) -> str:
    text = f"{e.role} worker {e.kind.value}"
    if e.kind is WorkerEventKind.DIED:
        text += f" ({e.cause})" if e.cause else ""
    elif e.kind is WorkerEventKind.RESTARTED and e.recovery_s is not None:
        text += f" after {e.recovery_s:.1f} s"
    return text


def stall_text(stall: Stall | None) -> str:
    """'412 ms ← req-7 (256 tok, same step)': the longest gap and the prompt whose prefill held it most
    ('beside': on the prefill worker, concurrently; 'granted to its deadline': a step the policy ran past the
    ITL budget so that req-7 kept its TTFT budget; 'at the gap ceiling, its deadline lost': one it ran as long
    as the ceiling for a req-7 late anyway; 'KV store 150 ms': saves and restores between steps in the gap);
    the prompt named as the request table names requests (``short_id``); '' when the request never stalled."""
    if stall is None:
        return ""
    store = f"KV store {stall.store_ms:.0f} ms" if stall.store_ms >= 1 else ""
    worst = stall.worst
    if worst is None:
        return f"{stall.gap_ms:.0f} ms ← {store}" if store else f"{stall.gap_ms:.0f} ms gap (no prompt in it)"
    where = ("same step" if worst.same_step else "beside") + worst.grant_note
    more = f" +{len(stall.culprits) - 1}" if len(stall.culprits) > 1 else ""
    return f"{stall.gap_ms:.0f} ms ← {short_id(worst.request_id)} ({worst.n_prompt_tokens} tok, {where}){more}" + \
        (f", {store}" if store else "")


def request_row(t: RequestTimings, itl_max_ms: float | None = None, stall: Stall | None = None) -> RequestRow:
    """A recent-requests row from a finished request's figures."""
    return RequestRow(
        request_id=t.request_id, state=t.state.value, n_prompt_tokens=t.n_prompt_tokens,
        n_output_tokens=t.n_output_tokens, ttft_ms=_ms(t.ttft_s), tpot_ms=_ms(t.tpot_s), itl_max_ms=itl_max_ms,
        kv_bytes=t.kv_bytes, stall=stall_text(stall), request_class=t.request_class)


def worst_stalls(stalls: Iterable[Stall]) -> dict[str, Stall]:
    """Request id -> its longest stall (``attribute_stalls`` sorts the longest first)."""
    out: dict[str, Stall] = {}
    for s in stalls:
        out.setdefault(s.request_id, s)
    return out


def chart_point(t_s: float, interval_s: float, finished: Sequence[RequestTimings], steps: StepSample | None = None,
                window_steps: Sequence | None = None) -> ChartPoint:
    """One tick of the live charts from the requests that finished in it and, where the
    step log is at hand, the steps that ended in it (``steps``: its counts are over every step, sampled or
    not) and the last minute of steps (``window_steps``, for the interference index)."""
    ttfts = [t.ttft_s * 1e3 for t in finished if t.ttft_s is not None]
    tpots = [t.tpot_s * 1e3 for t in finished if t.tpot_s is not None]
    itl = tok_s = slowdown = None
    if steps is not None:
        itl = steps.max_decode_step_ms
        tok_s = steps.n_decode_tokens / interval_s if interval_s > 0 else None
    elif interval_s > 0:
        tok_s = sum(t.n_output_tokens for t in finished) / interval_s
    if window_steps:
        slowdown = interference(list(window_steps)).slowdown
    return ChartPoint(t_s, ttft_ms=max(ttfts, default=None), itl_ms=itl,
                      tpot_ms=sum(tpots) / len(tpots) if tpots else None, tok_s=tok_s, interference=slowdown)


def kv_mb_s(finished: Sequence[RequestTimings], interval_s: float) -> float | None:
    """KV bytes handed off by the requests that finished in the tick, per second (None: nothing moved)."""
    moved = [t.kv_bytes for t in finished if t.kv_bytes]
    return sum(moved) / MB / interval_s if moved and interval_s > 0 else None


def chat_stats(timings: RequestTimings | None, mode: str, finish_reason: str | None,
               error: str | None = None) -> ChatStats:
    """Under a chat reply, from its figures (None: the reply ended before any came)."""
    if timings is None:
        return ChatStats(mode, None, None, None, 0, finish_reason, error=error)
    return ChatStats(
        mode=mode, ttft_ms=_ms(timings.ttft_s), tpot_ms=_ms(timings.tpot_s), n_prompt_tokens=timings.n_prompt_tokens,
        n_output_tokens=timings.n_output_tokens, finish_reason=finish_reason, kv_bytes=timings.kv_bytes,
        kv_transfer_ms=_ms(timings.kv_transfer_s), error=error, n_cached_tokens=timings.n_cached_tokens)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
