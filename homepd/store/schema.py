"""The store's schema, as sqlite-utils migrations (``sqlite_utils.Migrations``, sqlite-utils >= 4).

Each migration is applied once, in its own transaction, and recorded in
``_sqlite_migrations`` (set ``homepd.store``).  A released migration never
changes: a new column or table is a new function registered after the last
one.  Column names carry units; ``*_json`` columns hold JSON text.
"""
from __future__ import annotations

from sqlite_utils import Database, Migrations

from homepd.store.errors import StoreError

MIGRATIONS = Migrations("homepd.store")
MIGRATION_NAMES: list[str] = []  # in order of application


def _migration(name: str):
    MIGRATION_NAMES.append(name)
    return MIGRATIONS(name=name)


@_migration("0001_runs_results_requests_steps_recommendations")
def _initial(db: Database) -> None:
    db["runs"].create({
        "id": int, "kind": str, "status": str,
        "started_at": str, "ended_at": str,          # ISO 8601 wall time, UTC
        "writer_pid": int, "writer_start_ticks": int,  # who writes it (a dead writer -> incomplete)
        "homepd_version": str, "error": str,
        "hardware_json": str, "config_json": str, "trace_json": str,
    }, pk="id", not_null={"kind", "status", "started_at"})
    db["runs"].create_index(["started_at"])

    db["results"].create({
        "id": int, "run_id": int, "candidate": str, "mix": str, "repeat": int,
        "status": str, "reason": str, "created_at": str,   # status: measured | infeasible
        "mode": str, "trace_name": str,
        "n_requests": int, "n_finished": int, "n_failed": int, "n_worker_deaths": int,
        "ttft_p50_ms": float, "ttft_p99_ms": float, "tpot_p50_ms": float, "tpot_p99_ms": float,
        "itl_p99_ms": float, "itl_max_ms": float, "e2e_p99_ms": float,
        "prompt_tok_s": float, "output_tok_s": float, "goodput_per_s": float, "slo_attainment": float,
        "interference_slowdown": float, "total_pss_bytes": int, "kv_slot_bytes": int,
        "n_steps": int, "n_steps_kept": int,
        "record_json": str,                      # RunRecord.to_dict() without its requests
    }, pk="id", foreign_keys=[("run_id", "runs", "id")], not_null={"run_id", "candidate", "status"})
    db["results"].create_index(["run_id"])

    db["requests"].create({
        "id": int, "result_id": int, "request_id": str, "state": str,
        "n_prompt_tokens": int, "n_output_tokens": int, "ttft_ms": float, "tpot_ms": float,
        "lifecycle_json": str,                   # Lifecycle.to_dict() plus token_times_s
    }, pk="id", foreign_keys=[("result_id", "results", "id")], not_null={"result_id", "request_id"})
    db["requests"].create_index(["result_id"])

    db["steps"].create({
        "id": int, "result_id": int, "worker_role": str, "step_index": int,
        "t_start_s": float, "t_end_s": float, "n_decode_tokens": int, "n_prompt_tokens": int,
        "decode_request_ids_json": str, "prefill_json": str,
    }, pk="id", foreign_keys=[("result_id", "results", "id")], not_null={"result_id"})
    db["steps"].create_index(["result_id"])

    db["recommendations"].create({
        "id": int, "run_id": int, "created_at": str, "headline": str, "data_json": str,
    }, pk="id", foreign_keys=[("run_id", "runs", "id")], not_null={"run_id"})
    db["recommendations"].create_index(["run_id"])


@_migration("0002_traffic")
def _traffic(db: Database) -> None:
    # the shape of the traffic ``homepd serve`` served (``homepd.store.traffic``): no text unless asked
    db["traffic"].create({
        "id": int, "request_id": str, "service_id": str,   # service_id: which service process recorded it
        "arrived_at": str, "arrived_unix_s": float,         # wall time of arrival (ISO UTC, and Unix seconds)
        "route": str, "request_class": str, "finish_reason": str,
        "n_prompt_tokens": int, "n_output_tokens": int, "max_tokens": int,
        "n_prefix_tokens": int, "prefix_parent": str,      # seen before (service-side hashes), and by whom
        "n_cached_tokens": int,                            # what the engine's prefix cache reused
        "ttft_ms": float, "e2e_ms": float,
        "prompt_text": str,                                # NULL unless serve --record-text
    }, pk="id", not_null={"request_id", "arrived_unix_s", "n_prompt_tokens"})
    db["traffic"].create_index(["arrived_unix_s"])


@_migration("0003_traffic_slo_met")
def _traffic_slo_met(db: Database) -> None:
    # whether each request met its class's SLO (NULL: recorded before), so that live advice's profile
    # (``homepd.measure.profile``) keeps its SLO attainment across a restart
    db["traffic"].add_column("slo_met", int)


@_migration("0004_model_footprints")
def _model_footprints(db: Database) -> None:
    # each model's measured memory footprint and load time, per allocation that changes it
    # (``homepd.store.footprints``): the plan of a service with several models reads it before a load
    db["model_footprints"].create({
        "model_key": str, "n_ctx": int, "n_seq_max": int, "kv_type": str, "placement": str,
        "footprint_bytes": int, "estimate_bytes": int, "load_s": float, "n_loads": int,
        "measured_at": str, "model_name": str, "breakdown_json": str,
    }, pk=("model_key", "n_ctx", "n_seq_max", "kv_type", "placement"),
        not_null={"footprint_bytes", "measured_at"})


@_migration("0005_steps_kv_in_use")
def _steps_kv_in_use(db: Database) -> None:
    # the KV cells each stored step attended over (``StepRecord.kv_in_use``: its price in the twin's step model),
    # so that a stored check's steps can be priced again (NULL: stored before)
    db["steps"].add_column("kv_in_use", int)


def migrate(db: Database) -> list[str]:
    """Apply the pending migrations; return their names.  Refuses a database from a newer homepd."""
    unknown = [m.name for m in MIGRATIONS.applied(db) if m.name not in MIGRATION_NAMES]
    if unknown:
        raise StoreError(f"this database was written by a newer homepd (schema {', '.join(unknown)}); "
                         f"upgrade homepd or use another database (--db / HOMEPD_DB)")
    pending = [m.name for m in MIGRATIONS.pending(db)]
    if pending:
        MIGRATIONS.apply(db)
    return pending
