"""Metrics computed from request lifecycles and the step log.

Everything here is derived, never measured twice: TTFT, TPOT, queue wait come
from ``Lifecycle`` timestamps; interference comes from the step log — how much
longer a step that carries decode tokens takes when prompt tokens share it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from homepd.messages import StepRecord
from homepd.request import Lifecycle


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


@dataclass(frozen=True)
class Interference:
    """Decode-step slowdown caused by prompt tokens sharing the step."""
    decode_only_steps: int
    mixed_steps: int
    decode_only_ms: float | None   # median duration of steps with decode tokens only
    mixed_ms: float | None         # median duration of steps with decode and prompt tokens
    mixed_prompt_tokens: float | None  # mean prompt tokens in the mixed steps

    @property
    def slowdown(self) -> float | None:
        """mixed_ms / decode_only_ms: 1.0 = no interference."""
        if not self.decode_only_ms or self.mixed_ms is None:
            return None
        return self.mixed_ms / self.decode_only_ms


def interference(steps: list[StepRecord]) -> Interference:
    """Interference of prefill on decode, measured on the live step log."""
    only = [s.duration_ms for s in steps if s.n_decode_tokens and not s.n_prompt_tokens]
    mixed = [s for s in steps if s.n_decode_tokens and s.n_prompt_tokens]
    return Interference(
        decode_only_steps=len(only), mixed_steps=len(mixed),
        decode_only_ms=statistics.median(only) if only else None,
        mixed_ms=statistics.median(s.duration_ms for s in mixed) if mixed else None,
        mixed_prompt_tokens=statistics.mean(s.n_prompt_tokens for s in mixed) if mixed else None)


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
        # disaggregated: the KV handoff
        "kv_bytes_mean": statistics.mean(r.kv_bytes for r in moved) if moved else None,
        "kv_transfer_ms_p50": percentile(transfer, 50), "kv_transfer_ms_p95": percentile(transfer, 95),
        "kv_export_ms_p50": percentile([r.kv_export_s * 1e3 for r in moved if r.kv_export_s is not None], 50),
        "kv_import_ms_p50": percentile([r.kv_import_s * 1e3 for r in moved if r.kv_import_s is not None], 50),
        "kv_slot_wait_ms_p95": percentile([r.kv_slot_wait_s * 1e3 for r in moved
                                           if r.kv_slot_wait_s is not None], 95),
    }
