"""Earlier calibrations of a candidate on this box, which its twin pools with the run's own.

A calibration burst sees the box for about 17 seconds.  On a 2-vCPU VM, bursts of the same candidate a few minutes
apart fitted steps 25 % apart and step-time tails twice as long, and the twin's capacity moved ×2 with them: the
answer followed the minute a burst ran in, not the box.  So the twin of a candidate runs its seeds on this run's
calibration and on up to ``MAX_EARLIER`` earlier ones (``homepd.twin.capacity``, ``pool``), taken from the store
when they are of:

* the same box: its host name, CPU model and logical cores;
* the same candidate, with the same workers (every ``WorkerSpec`` field but the wire's fingerprint, which changes
  with homepd's version, not with the box): model, context, sequences, threads, cores, chunk and budgets;
* a complete run, started within ``MAX_AGE`` of this one;
* a quiet burst: one during which other processes used a quarter of a core or more (``Calibration.busy``) is the
  neighbour's, not the box's, and is left out (this run's own is used, with the report's warning).

Each run adds its burst; the report names the runs pooled, and ``--twin-pool 0`` uses this run's alone.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging

from homepd.twin.calibration import Calibration

log = logging.getLogger("homepd.advise")

MAX_EARLIER = 3
MAX_AGE = dt.timedelta(hours=24)
N_RUNS_LOOKED_AT = 30


def box_identity(hardware: dict | None) -> tuple | None:
    """What makes two runs' boxes the same box: host name, CPU model, logical cores (None: not probed)."""
    if not hardware or not isinstance(hardware.get("cpu"), dict):
        return None
    cpu = hardware["cpu"]
    return hardware.get("hostname"), cpu.get("model"), cpu.get("logical_cores")


def same_workers(a: Calibration, b: Calibration) -> bool:
    """The same workers, spec for spec, but for the wire's fingerprint (homepd's version)."""
    if len(a.workers) != len(b.workers):
        return False
    return all(wa.name == wb.name and dataclasses.replace(wa.spec, wire="") == dataclasses.replace(wb.spec, wire="")
               for wa, wb in zip(a.workers, b.workers))


def earlier_calibrations(store, run_id: int | None, candidate: str, cal: Calibration, hardware: dict | None,
                         now: dt.datetime, limit: int = MAX_EARLIER) -> list[tuple[int, Calibration]]:
    """Up to ``limit`` (run id, calibration) of ``candidate`` from earlier complete runs of this box, newest first,
    that ``same_workers`` as ``cal`` and started within ``MAX_AGE`` of ``now``."""
    box = box_identity(hardware)
    if store is None or limit <= 0 or box is None:
        return []
    found: list[tuple[int, Calibration]] = []
    for row in store.list_runs(limit=N_RUNS_LOOKED_AT):
        if len(found) >= limit:
            break
        if row["id"] == run_id or row["status"] != "complete" or candidate not in row["candidates"]:
            continue
        started = _parse_time(row.get("started_at"))
        if started is None or now - started > MAX_AGE:
            continue
        try:
            run = store.load_run(row["id"], timelines=False)
        except Exception as e:  # a row an older homepd wrote that no longer decodes: skip it, say so
            log.info("run %s not pooled: %s", row["id"], e)
            continue
        if box_identity(run.hardware) != box or run.advice is None:
            continue
        twin = next((t for t in run.advice.twins if t.candidate == candidate), None)
        if twin is not None and not twin.calibration.busy and same_workers(twin.calibration, cal):
            found.append((row["id"], twin.calibration))
    return found


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.timezone.utc)
