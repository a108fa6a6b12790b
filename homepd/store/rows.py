"""Rows of the store's tables: records in (RunRecord, Lifecycle, StepRecord -> row dicts), plain dicts out.

Pure functions, no database: what a row holds is decided here, how it is
written in ``homepd.store.store``.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from homepd.core.lifecycle import Lifecycle
from homepd.core.protocol import StepRecord
from homepd.core.records import WorkerEventKind, to_plain
from homepd.measure.replay import RunRecord

# why: an advise run makes tens of results of a few thousand steps each; 1000 evenly spaced steps per
# result keep the step-time picture (and the database a few MB) without the full log
MAX_STEPS_PER_RESULT = 1000


def to_json(obj: Any) -> str:
    """Dataclasses, enums, tuples and dicts as JSON text (anything else, e.g. a Path, as its str)."""
    return json.dumps(to_plain(obj), default=str, separators=(",", ":"))


def from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def sample_evenly(items: Sequence, n_max: int) -> list:
    """At most ``n_max`` of ``items``, evenly spaced, first and last included, order kept."""
    n = len(items)
    if n <= n_max:
        return list(items)
    if n_max <= 1:
        return list(items[:n_max])
    return [items[round(i * (n - 1) / (n_max - 1))] for i in range(n_max)]


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1e3


def result_row(record: RunRecord, n_steps_kept: int) -> dict:
    """The flattened, queryable columns of one measured result, plus the record as JSON (requests apart)."""
    s = record.summary
    body = record.to_dict()
    body.pop("requests")
    return {
        "status": "measured", "mode": record.mode, "trace_name": record.trace_name,
        "n_requests": s.n_requests, "n_finished": s.n_finished, "n_failed": s.n_failed,
        "n_worker_deaths": sum(ev.kind is WorkerEventKind.DIED for ev in record.worker_events),
        "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99,
        "tpot_p50_ms": s.tpot_ms.p50, "tpot_p99_ms": s.tpot_ms.p99,
        "itl_p99_ms": s.itl_ms.p99, "itl_max_ms": s.itl_ms.max, "e2e_p99_ms": s.e2e_ms.p99,
        "prompt_tok_s": s.prompt_tok_s, "output_tok_s": s.output_tok_s, "goodput_per_s": s.goodput_per_s,
        "slo_attainment": s.slo_attainment, "interference_slowdown": s.interference.slowdown,
        "total_pss_bytes": record.total_pss_bytes, "kv_slot_bytes": record.kv_arena_bytes,  # the column's released name
        "n_steps": s.n_steps, "n_steps_kept": n_steps_kept, "record_json": to_json(body),
    }


def lifecycle_dict(lc: Lifecycle) -> dict:
    """``Lifecycle.to_dict()`` plus the time of every token (the per-request timeline)."""
    return {**lc.to_dict(), "token_times_s": list(lc.token_times_s)}


def request_row(lc: Lifecycle) -> dict:
    return {"request_id": lc.request_id, "state": lc.state.value, "n_prompt_tokens": lc.n_prompt_tokens,
            "n_output_tokens": len(lc.token_times_s), "ttft_ms": _ms(lc.ttft_s), "tpot_ms": _ms(lc.tpot_s),
            "lifecycle_json": to_json(lifecycle_dict(lc))}


def step_row(step: StepRecord) -> dict:
    return {"worker_role": step.worker_role, "step_index": step.index, "t_start_s": step.t_start_s,
            "t_end_s": step.t_end_s, "n_decode_tokens": step.n_decode_tokens, "n_prompt_tokens": step.n_prompt_tokens,
            "decode_request_ids_json": to_json(step.decode_request_ids), "prefill_json": to_json(step.prefill),
            "kv_in_use": step.kv_in_use}


# ---- out: rows -> plain dicts -----------------------------------------------------------------

def decode_row(row: dict) -> dict:
    """A row with each ``x_json`` column replaced by ``x`` holding the decoded value."""
    out = {}
    for key, value in row.items():
        if key.endswith("_json"):
            out[key[:-len("_json")]] = from_json(value)
        else:
            out[key] = value
    return out


def step_dict(row: dict) -> dict:
    """A stored step as ``StepRecord``'s fields (plus the derived token counts)."""
    d = decode_row(row)
    return {"worker_role": d["worker_role"], "index": d["step_index"], "t_start_s": d["t_start_s"],
            "t_end_s": d["t_end_s"], "decode_request_ids": d["decode_request_ids"], "prefill": d["prefill"],
            "n_decode_tokens": d["n_decode_tokens"], "n_prompt_tokens": d["n_prompt_tokens"],
            "kv_in_use": d.get("kv_in_use") or 0}


def recommendation_headline(data: dict) -> str | None:
    """The one-liner of a recommendation: its ``headline``, else ``summary``, else ``architecture``."""
    for key in ("headline", "summary", "architecture"):
        value = data.get(key)
        if isinstance(value, str) and value:
            return value
    return None
