"""Pure functions: sampler snapshots, engine snapshots, lifecycles and step logs -> the app's view records.

The engine's snapshot and request lifecycles arrive here as the JSON shapes of
``EngineSnapshot.to_dict()`` and ``Lifecycle.to_dict()`` — what the embedded
engine gives after ``to_dict`` and what ``homepd serve`` sends on ``/status``
and ``/events`` — so one code path serves both sources.  No Textual, no I/O.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

from homepd.measure.metrics import interference
from homepd.measure.stalls import Stall
from homepd.tui.records import (ArchitectureView, ChartPoint, ChatStats, GpuView, HardwareView, ProcessView,
                                RequestRow, WorkerView)

MB = 1e6


def cores_text(cores: Sequence[int] | None) -> str:
    """(0, 1, 2, 5) -> '0-2,5'; '' when not pinned."""
    if not cores:
        return ""
    cores = sorted(cores)
    parts, start, prev = [], cores[0], cores[0]
    for c in list(cores[1:]) + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


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


def architecture_view(engine: dict, kv_mb_s: float | None = None, note: str = "") -> ArchitectureView:
    """The architecture panel from an engine snapshot as JSON (``EngineSnapshot.to_dict()``)."""
    workers = tuple(WorkerView(
        role=w["role"], pid=w.get("pid"), alive=bool(w.get("alive")), ready=bool(w.get("ready")),
        restarts=int(w.get("restarts") or 0), n_threads=int(w.get("n_threads") or 0),
        cores=cores_text(w.get("cpu_cores")), gpu=w.get("cuda_visible_devices") or "",
        n_running=len(w.get("in_flight") or ()), backlog=int(w.get("backlog") or 0), failed=w.get("failed"))
        for w in engine.get("workers") or ())
    kv = engine.get("kv_slots") or {}
    events = tuple(_event_text(e) for e in (engine.get("worker_events") or ())[-3:])
    return ArchitectureView(
        mode=engine.get("mode", "?"), model=os.path.basename(engine.get("model") or "?"),
        chunk=engine.get("chunk"), n_ctx=int(engine.get("n_ctx") or 0), workers=workers,
        by_state={state: len(ids) for state, ids in (engine.get("requests") or {}).items()},
        kv_slots=int(kv.get("n_slots") or 0), kv_slot_bytes=int(kv.get("capacity_bytes") or 0),
        kv_occupancy=dict(kv.get("occupancy") or {}), kv_mb_s=kv_mb_s, events=events, note=note,
        **admission_lines(engine.get("admission")))


def admission_lines(adm: dict | None) -> dict:
    """Two queues, two budgets as panel lines: per class what waits and what admission decided; each worker's
    latest prompt budget (the chunk chosen for its step), how far TTFT predictions were off, and routing."""
    if not adm:
        return {}
    classes = []
    for c in adm.get("classes") or ():
        itl = f" ITL ≤{c['itl_budget_ms']:.0f} ms" if c.get("itl_budget_ms") else ""
        classes.append(f"{c['request_class']}: {c['queued_requests']} queued ({c['queued_prompt_tokens']} tok) · "
                       f"{c['running']} in · admitted {c['admitted']} · deferred {c['deferred']} · rejected "
                       f"{c['rejected']} · TTFT ≤{c['ttft_budget_ms'] / 1e3:g} s{itl}")
    parts = [f"{role} {n}" for role, n in sorted((adm.get("chunk_by_worker") or {}).items())]
    text = ("chunk " + ", ".join(parts) + (" (adaptive)" if adm.get("adaptive_chunk") else "")) if parts else ""
    if adm.get("ttft_error_mean_ms") is not None:
        text += f" · TTFT predicted ±{adm['ttft_error_mean_ms']:.0f} ms (p90 {adm['ttft_error_p90_ms']:.0f})"
    if adm.get("routed_local") or adm.get("routed_remote"):
        text += f" · routed local {adm['routed_local']} / remote {adm['routed_remote']}"
    return {"classes": tuple(classes), "budgets": text.lstrip(" ·")}


def _event_text(e: dict) -> str:
    text = f"{e.get('role')} worker {e.get('kind')}"
    if e.get("kind") == "died":
        text += f" ({e.get('cause')})" if e.get("cause") else ""
    elif e.get("kind") == "restarted" and e.get("recovery_s") is not None:
        text += f" after {e['recovery_s']:.1f} s"
    return text


def stall_text(stall: Stall | None) -> str:
    """'412 ms ← req-7 (256 tok, same step)': the longest gap and the prompt whose prefill held it most
    ('beside': on the prefill worker, concurrently); '' when the request never stalled."""
    if stall is None:
        return ""
    worst = stall.worst
    if worst is None:
        return f"{stall.gap_ms:.0f} ms gap (no prompt in it)"
    where = "same step" if worst.same_step else "beside"
    more = f" +{len(stall.culprits) - 1}" if len(stall.culprits) > 1 else ""
    return f"{stall.gap_ms:.0f} ms ← {worst.request_id} ({worst.n_prompt_tokens} tok, {where}){more}"


def request_row(lc: dict, itl_max_ms: float | None = None, stall: Stall | None = None) -> RequestRow:
    """A recent-requests row from a lifecycle as JSON (``Lifecycle.to_dict()``, or a ``/events`` request)."""
    return RequestRow(
        request_id=lc["request_id"], state=lc.get("state") or "?", n_prompt_tokens=int(lc.get("n_prompt_tokens") or 0),
        n_output_tokens=int(lc.get("n_output_tokens") or 0), ttft_ms=_ms(lc.get("ttft_s")),
        tpot_ms=_ms(lc.get("tpot_s")), itl_max_ms=itl_max_ms, kv_bytes=lc.get("kv_bytes"),
        stall=stall_text(stall), request_class=lc.get("request_class") or "")


def worst_stalls(stalls: Iterable[Stall]) -> dict[str, Stall]:
    """Request id -> its longest stall (``attribute_stalls`` sorts the longest first)."""
    out: dict[str, Stall] = {}
    for s in stalls:
        out.setdefault(s.request_id, s)
    return out


def chart_point(t_s: float, interval_s: float, finished: Sequence[dict], steps: Sequence | None = None,
                window_steps: Sequence | None = None) -> ChartPoint:
    """One tick of the live charts from the requests that finished in it (lifecycle JSON) and, where the
    step log is at hand, the steps that ended in it (``steps``) and the last minute of steps
    (``window_steps``, for the interference index)."""
    ttfts = [lc["ttft_s"] * 1e3 for lc in finished if lc.get("ttft_s") is not None]
    tpots = [lc["tpot_s"] * 1e3 for lc in finished if lc.get("tpot_s") is not None]
    itl = tok_s = slowdown = None
    if steps is not None:
        decode_steps = [s for s in steps if s.n_decode_tokens]
        itl = max((s.duration_ms for s in decode_steps), default=None)
        tok_s = sum(s.n_decode_tokens for s in decode_steps) / interval_s if interval_s > 0 else None
    elif interval_s > 0:
        tok_s = sum(int(lc.get("n_output_tokens") or 0) for lc in finished) / interval_s
    if window_steps:
        slowdown = interference(list(window_steps)).slowdown
    return ChartPoint(t_s, ttft_ms=max(ttfts, default=None), itl_ms=itl,
                      tpot_ms=sum(tpots) / len(tpots) if tpots else None, tok_s=tok_s, interference=slowdown)


def kv_mb_s(finished: Sequence[dict], interval_s: float) -> float | None:
    """KV bytes handed off by the requests that finished in the tick, per second (None: nothing moved)."""
    moved = [int(lc["kv_bytes"]) for lc in finished if lc.get("kv_bytes")]
    return sum(moved) / MB / interval_s if moved and interval_s > 0 else None


def chat_stats(timings: dict, mode: str, finish_reason: str | None, error: str | None = None) -> ChatStats:
    """Under a chat reply, from a lifecycle as JSON or from ``homepd serve``'s ``homepd`` timings."""
    transfer_s = timings.get("transfer_s", timings.get("kv_transfer_s"))
    return ChatStats(
        mode=timings.get("mode") or mode, ttft_ms=_ms(timings.get("ttft_s")), tpot_ms=_ms(timings.get("tpot_s")),
        n_prompt_tokens=timings.get("n_prompt_tokens"), n_output_tokens=int(timings.get("n_output_tokens") or 0),
        finish_reason=finish_reason, kv_bytes=timings.get("kv_bytes"), kv_transfer_ms=_ms(transfer_s), error=error)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
