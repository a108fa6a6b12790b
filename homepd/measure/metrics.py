"""Metrics computed from request lifecycles and the step log.

Everything here is derived, never measured twice: TTFT, TPOT, queue wait come
from ``Lifecycle`` timestamps; interference comes from the step log — how much
longer a decode step takes when prompt tokens share it (colocated) or when the
prefill worker runs at the same time (disaggregated).
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

from homepd.core.protocol import StepRecord
from homepd.core.lifecycle import Lifecycle


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


@dataclass(frozen=True)
class Interference:
    """How much longer decode steps take when prefill work disturbs them.

    Colocated: a decode step is disturbed when prompt tokens share it.
    Disaggregated: when a prefill step of the other worker ran at the same time
    (shared memory bandwidth, caches, SMT siblings or the GPU).
    """
    decode_only_steps: int
    mixed_steps: int
    decode_only_ms: float | None   # median duration of undisturbed decode steps
    mixed_ms: float | None         # median duration of disturbed decode steps
    mixed_prompt_tokens: float | None  # mean prompt tokens in (or beside) the disturbed steps
    slowdown: float | None         # disturbed / undisturbed, matched on decode batch size; 1.0 = none


def _overlapping_prefill(step: StepRecord, starts: list[float], spans: list[StepRecord]) -> StepRecord | None:
    """The prefill step that ran during at least half of ``step``, if any."""
    # why: one prefill worker's steps are disjoint and ordered: check the ones starting before step ends
    i = bisect.bisect_left(starts, step.t_end_s) - 1
    length = step.t_end_s - step.t_start_s
    overlap, best = 0.0, None
    while i >= 0 and spans[i].t_end_s > step.t_start_s:
        shared = min(spans[i].t_end_s, step.t_end_s) - max(spans[i].t_start_s, step.t_start_s)
        overlap += shared
        best = best or spans[i]
        i -= 1
    return best if length > 0 and overlap >= length / 2 else None


def interference(steps: list[StepRecord]) -> Interference:
    """Interference of prefill on decode, measured on the live step log."""
    spans = sorted((s for s in steps if s.worker_role == "prefill"), key=lambda s: s.t_start_s)
    starts = [s.t_start_s for s in spans]
    alone: dict[int, list[float]] = {}
    mixed: dict[int, list[float]] = {}
    prompt_tokens: list[int] = []
    for s in steps:
        if not s.n_decode_tokens:
            continue
        beside = None if s.n_prompt_tokens else _overlapping_prefill(s, starts, spans)
        if s.n_prompt_tokens or beside is not None:
            mixed.setdefault(s.n_decode_tokens, []).append(s.duration_ms)
            prompt_tokens.append(s.n_prompt_tokens or beside.n_prompt_tokens)
        else:
            alone.setdefault(s.n_decode_tokens, []).append(s.duration_ms)
    matched = [(len(mixed[n]), statistics.median(mixed[n]) / statistics.median(alone[n]))
               for n in mixed if n in alone]
    all_alone = [d for ds in alone.values() for d in ds]
    all_mixed = [d for ds in mixed.values() for d in ds]
    return Interference(
        decode_only_steps=len(all_alone), mixed_steps=len(all_mixed),
        decode_only_ms=statistics.median(all_alone) if all_alone else None,
        mixed_ms=statistics.median(all_mixed) if all_mixed else None,
        mixed_prompt_tokens=statistics.mean(prompt_tokens) if prompt_tokens else None,
        slowdown=sum(w * r for w, r in matched) / sum(w for w, _ in matched) if matched else None)


def summarize(records: list[Lifecycle], steps: list[StepRecord]) -> dict:
    """Run-level figures (seconds in, milliseconds out) for a set of finished requests."""
    done = [r for r in records if r.state.value == "finished"]
    ttft = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s * 1e3 for r in done if r.tpot_s is not None]
    itl = [x * 1e3 for r in done for x in r.itl_s]
    queue = [r.queue_wait_s * 1e3 for r in done if r.queue_wait_s is not None]
    prompt_steps = [s for s in steps if s.n_prompt_tokens]
    prompt_step_s = sum(s.t_end_s - s.t_start_s for s in prompt_steps)
    n_prompt = sum(r.n_prompt_tokens for r in done)
    n_out = sum(len(r.token_times_s) for r in done)
    span_s = (max(r.ended_s for r in done) - min(r.arrived_s for r in done)) if done else 0.0
    inter = interference(steps)
    moved = [r for r in done if r.kv_bytes]
    transfer = [r.transfer_s * 1e3 for r in moved if r.transfer_s is not None]
    return {
        "n_requests": len(records), "n_finished": len(done),
        "n_failed": sum(r.state.value == "failed" for r in records),
        "n_cancelled": sum(r.state.value == "cancelled" for r in records),
        "n_resumed": sum(r.n_resumes > 0 for r in records),
        "n_prompt_tokens": n_prompt, "n_output_tokens": n_out, "span_s": span_s,
        # prompt tokens per second of the steps that carried prompt tokens
        "prompt_tok_s": sum(s.n_prompt_tokens for s in prompt_steps) / prompt_step_s if prompt_step_s else None,
        "output_tok_s": n_out / span_s if span_s > 0 else None,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p95": percentile(ttft, 95),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p95": percentile(tpot, 95),
        "itl_ms_p95": percentile(itl, 95), "itl_ms_max": max(itl) if itl else None,
        "queue_ms_p50": percentile(queue, 50), "queue_ms_p95": percentile(queue, 95),
        "n_steps": len(steps),
        "max_prompt_tokens_per_step": max((s.n_prompt_tokens for s in steps), default=0),
        "interference_decode_only_ms": inter.decode_only_ms, "interference_mixed_ms": inter.mixed_ms,
        "interference_slowdown": inter.slowdown,
        "interference_kind": "concurrent" if any(s.worker_role == "prefill" for s in steps) else "same_step",
        # disaggregated: the KV handoff
        "kv_bytes_mean": statistics.mean(r.kv_bytes for r in moved) if moved else None,
        "kv_transfer_ms_p50": percentile(transfer, 50), "kv_transfer_ms_p95": percentile(transfer, 95),
        "kv_export_ms_p50": percentile([r.kv_export_s * 1e3 for r in moved if r.kv_export_s is not None], 50),
        "kv_import_ms_p50": percentile([r.kv_import_s * 1e3 for r in moved if r.kv_import_s is not None], 50),
        "kv_slot_wait_ms_p95": percentile([r.kv_slot_wait_s * 1e3 for r in moved
                                           if r.kv_slot_wait_s is not None], 95),
    }
