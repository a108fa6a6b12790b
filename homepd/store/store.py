"""``Store``: the run database (one writer, WAL, every write one transaction).

A run is begun, gets results (one per candidate x prompt mix x repeat, each
written whole in one transaction with its request timelines and sampled
steps) and recommendations, and is finished.  A run still ``running`` whose
writer process is gone is marked ``incomplete`` whenever a store is opened or
runs are read.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator, Sequence

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from homepd.core.protocol import StepRecord
from homepd.measure.replay import RunRecord
from homepd.osutil import pid_alive
from homepd.store import rows
from homepd.store.errors import RunNotFoundError, StoreError
from homepd.store.paths import default_db_path
from homepd.store.records import Run, decode_run
from homepd.store.schema import migrate

RUN_STATUSES = ("running", "complete", "incomplete", "failed")
BUSY_TIMEOUT_S = 10.0   # a reader or a second writer waits this long for the lock
FORMAT_VERSION = 1      # of export_run's JSON


def now_iso() -> str:
    """Wall time now, ISO 8601 in UTC (milliseconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def homepd_version() -> str:
    try:
        return importlib.metadata.version("homepd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # why: field 2 (comm) may hold spaces and parentheses; the fields after it follow the last ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def writer_alive(pid: int | None, start_ticks: int | None) -> bool:
    """Whether the process that wrote a run still runs (a reused pid with another start time does not count)."""
    if pid is None or not pid_alive(pid):
        return False
    now_ticks = process_start_ticks(pid)
    return start_ticks is None or now_ticks is None or now_ticks == start_ticks


class Store:
    """The run database.  Open with ``Store.open``; close (or use as a context manager) when done."""

    def __init__(self, db: Database, path: str):
        self.db, self.path = db, path
        self._lock = threading.RLock()  # why: one connection, shared by threads (asyncio.to_thread, TUI workers)

    @classmethod
    def open(cls, path: str | Path | None = None, *, create: bool = True) -> "Store":
        """Open (and migrate) the database at ``path`` (default ``default_db_path()``; ``":memory:"`` works).

        ``create=False`` refuses a missing file with a ``StoreError`` instead of creating it.
        """
        target = default_db_path() if path is None else Path(path)
        memory = str(target) == ":memory:"
        if not memory and not target.exists():
            if not create:
                raise StoreError(f"no run database at {target} (run `homepd advise` first, or pass --db)")
            target.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(":memory:" if memory else str(target), timeout=BUSY_TIMEOUT_S,
                               check_same_thread=False)
        try:
            db = Database(conn)
            db.execute("PRAGMA foreign_keys=ON")
            if not memory:
                db.enable_wal()
                db.execute("PRAGMA synchronous=NORMAL")  # why: in WAL, safe against a crash of the process
            migrate(db)
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{target} is not a usable homepd run database: {exc}") from None
        except BaseException:
            conn.close()
            raise
        store = cls(db, str(target))
        store.mark_abandoned()
        return store

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[Database]:
        with self._lock, self.db.atomic():
            yield self.db

    # ---- writing ------------------------------------------------------------------------------

    def begin_run(self, kind: str, config: dict, hardware: dict | None = None, trace: dict | None = None) -> int:
        """Record a new run (status ``running``, written by this process); return its id.

        ``kind`` names what made it (``"advise"``, ``"run"``); ``config`` is the full configuration,
        ``hardware`` the probe snapshot, ``trace`` a description of the traces (any JSON-ready data or
        dataclasses).
        """
        row = {"kind": kind, "status": "running", "started_at": now_iso(), "writer_pid": os.getpid(),
               "writer_start_ticks": process_start_ticks(os.getpid()), "homepd_version": homepd_version(),
               "hardware_json": rows.to_json(hardware), "config_json": rows.to_json(config),
               "trace_json": rows.to_json(trace)}
        with self._write() as db:
            return db["runs"].insert(row).last_pk

    def add_result(self, run_id: int, candidate: str, mix: str, repeat: int, record: RunRecord,
                   steps: Sequence[StepRecord] = ()) -> int:
        """Add one measured candidate x prompt mix x repeat: the record, its request timelines and at most
        ``MAX_STEPS_PER_RESULT`` of ``steps`` (evenly sampled), all in one transaction.  Returns the result id."""
        kept = rows.sample_evenly(list(steps), rows.MAX_STEPS_PER_RESULT)
        row = {"run_id": run_id, "candidate": candidate, "mix": mix, "repeat": repeat, "created_at": now_iso(),
               **rows.result_row(record, len(kept))}
        with self._write() as db:
            self._require_running(run_id)
            result_id = db["results"].insert(row).last_pk
            db["requests"].insert_all({"result_id": result_id, **rows.request_row(lc)} for lc in record.requests)
            db["steps"].insert_all({"result_id": result_id, **rows.step_row(s)} for s in kept)
        return result_id

    def add_infeasible(self, run_id: int, candidate: str, reason: str, mix: str | None = None) -> int:
        """Record a candidate that was not measured, with why (it shows in the evidence).  Returns its id."""
        row = {"run_id": run_id, "candidate": candidate, "mix": mix, "status": "infeasible", "reason": reason,
               "created_at": now_iso()}
        with self._write() as db:
            self._require_running(run_id)
            return db["results"].insert(row).last_pk

    def add_recommendation(self, run_id: int, data: dict, headline: str | None = None) -> int:
        """Store a recommendation (JSON-ready ``data``) with a one-line ``headline`` for listings (default:
        ``data``'s ``headline``, ``summary`` or ``architecture``).  Returns its id."""
        row = {"run_id": run_id, "created_at": now_iso(), "data_json": rows.to_json(data),
               "headline": headline or rows.recommendation_headline(data)}
        with self._write() as db:
            self._require_running(run_id)
            return db["recommendations"].insert(row).last_pk

    def finish_run(self, run_id: int, status: str = "complete", error: str | None = None) -> None:
        """End a running run as ``complete``, ``incomplete`` (interrupted) or ``failed`` (with ``error``)."""
        if status not in RUN_STATUSES[1:]:
            raise StoreError(f"a run finishes as one of {', '.join(RUN_STATUSES[1:])}, not {status!r}")
        with self._write() as db:
            self._require_running(run_id)
            db["runs"].update(run_id, {"status": status, "ended_at": now_iso(), "error": error})

    @contextlib.contextmanager
    def recording(self, kind: str, config: dict, hardware: dict | None = None,
                  trace: dict | None = None) -> Iterator[int]:
        """``with store.recording(...) as run_id:`` — begin a run; finish it ``complete`` when the block
        ends, ``incomplete`` on Ctrl-C or cancellation, ``failed`` (with the error) on any other exception."""
        run_id = self.begin_run(kind, config, hardware, trace)
        try:
            yield run_id
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            self.finish_run(run_id, "incomplete", error=type(exc).__name__)
            raise
        except BaseException as exc:
            self.finish_run(run_id, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        else:
            self.finish_run(run_id, "complete")

    def mark_abandoned(self) -> list[int]:
        """Mark every ``running`` run whose writer process is gone as ``incomplete``; return their ids."""
        with self._lock:
            running = list(self.db.query("SELECT id, writer_pid, writer_start_ticks FROM runs "
                                         "WHERE status = 'running'"))
            dead = [r for r in running if not writer_alive(r["writer_pid"], r["writer_start_ticks"])]
            if not dead:
                return []
            with self._write() as db:
                for r in dead:
                    # why: re-check inside the transaction: another reader may have marked it already
                    db.execute("UPDATE runs SET status = 'incomplete', error = ? WHERE id = ? AND status = 'running'",
                               [f"writer process {r['writer_pid']} ended without finishing the run", r["id"]])
            return [r["id"] for r in dead]

    def _require_running(self, run_id: int) -> None:
        status = self._run_row(run_id)["status"]
        if status != "running":
            raise StoreError(f"run {run_id} is {status}: nothing more can be added to it")

    # ---- reading ------------------------------------------------------------------------------

    def _run_row(self, run_id: int) -> dict:
        try:
            return self.db["runs"].get(run_id)
        except NotFoundError:
            raise RunNotFoundError(str(run_id), self.path) from None

    def resolve_run(self, ref: str | int) -> int:
        """The id of the run ``ref`` names: an id, or ``"last"`` (the most recent).  RunNotFoundError if none."""
        with self._lock:
            if str(ref).strip().lower() == "last":
                row = next(self.db.query("SELECT max(id) AS id FROM runs"))
                if row["id"] is None:
                    raise RunNotFoundError(str(ref), self.path)
                return row["id"]
            try:
                run_id = int(str(ref).strip())
            except ValueError:
                raise RunNotFoundError(str(ref), self.path) from None
            self._run_row(run_id)
            return run_id

    def list_runs(self, limit: int = 20) -> list[dict]:
        """The newest ``limit`` runs, newest first: the run's columns (JSON ones left out) plus
        ``n_results``, ``candidates`` (in order of measurement), ``mixes`` and ``recommendation`` (headline)."""
        self.mark_abandoned()
        with self._lock:
            runs = list(self.db.query(
                "SELECT id, kind, status, started_at, ended_at, writer_pid, homepd_version, error FROM runs "
                "ORDER BY id DESC LIMIT ?", [limit]))
            for run in runs:
                results = list(self.db.query("SELECT candidate, mix FROM results WHERE run_id = ? ORDER BY id",
                                             [run["id"]]))
                run["n_results"] = len(results)
                run["candidates"] = list(dict.fromkeys(r["candidate"] for r in results))
                run["mixes"] = list(dict.fromkeys(r["mix"] for r in results if r["mix"] is not None))
                rec = list(self.db.query("SELECT headline FROM recommendations WHERE run_id = ? "
                                         "ORDER BY id DESC LIMIT 1", [run["id"]]))
                run["recommendation"] = rec[0]["headline"] if rec else None
        return runs

    def get_run(self, run_id: int, timelines: bool = True) -> dict:
        """One run, everything as plain dicts: the run's columns (``*_json`` decoded, suffix dropped),
        ``results`` (each with its ``record``; with ``timelines``, ``record["requests"]`` holds the request
        timelines and ``steps`` the sampled steps) and ``recommendations``."""
        self.mark_abandoned()
        with self._lock:
            run = rows.decode_row(self._run_row(run_id))
            results = [rows.decode_row(r) for r in self.db["results"].rows_where("run_id = ?", [run_id],
                                                                                   order_by="id")]
            for result in results:
                if timelines and result["record"] is not None:
                    result["record"]["requests"] = [
                        rows.from_json(r["lifecycle_json"]) for r in
                        self.db["requests"].rows_where("result_id = ?", [result["id"]], order_by="id")]
                    result["steps"] = [rows.step_dict(s) for s in
                                       self.db["steps"].rows_where("result_id = ?", [result["id"]], order_by="id")]
            run["results"] = results
            run["recommendations"] = [rows.decode_row(r) for r in self.db["recommendations"].rows_where(
                "run_id = ?", [run_id], order_by="id")]
        return run

    def load_run(self, run_id: int, timelines: bool = True) -> Run:
        """``get_run`` decoded once into a typed ``Run`` (``homepd.store.records``): what every reader of a
        run reads.  ``RecordShapeError`` names the field of a corrupt row."""
        return decode_run(self.get_run(run_id, timelines=timelines))

    def export_run(self, run_id: int) -> dict:
        """``get_run`` with timelines, tagged with the export format and its version (JSON-ready)."""
        return {"format": "homepd-run", "format_version": FORMAT_VERSION, **self.get_run(run_id)}

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` (``"ok"`` for a sound file)."""
        with self._lock:
            return "\n".join(row[0] for row in self.db.execute("PRAGMA integrity_check").fetchall())
