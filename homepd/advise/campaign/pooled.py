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
  neighbour's, not the box's, and one in which the box stopped a step for three times its time or more
  (``Calibration.n_stalled``: a page-fault storm, the VM's neighbour) is that minute's; both are left out (this
  run's own is used, with the report's warning).  One stalled burst pooled had spread the next run's colocated
  seeds over 0.12-1.00 req/s (half-width 73 %) where the bursts around it gave 0.77-1.09;
* a burst its own checks confirmed: one whose checks ran their steps more than ``DRIFTED`` faster or slower than
  it priced them (``homepd.twin.check.drift``) saw a minute of the box unlike the one after it.  A colocated
  burst on the 2-vCPU VM priced steps 1/0.70 of what its check ran them at (its twin 0.21 req/s, where the runs
  around it gave 0.8-1.3), and pooled, it spread the next run's seeds over 0.15-1.68 req/s (half-width 82 %).

Each run adds its burst; the report names the runs pooled, and ``--twin-pool 0`` uses this run's alone.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging

from homepd.core.records import RecordShapeError
from homepd.store.errors import RunNotFoundError
from homepd.store.records import Run
from homepd.twin.calibration import Calibration
from homepd.twin.check import drift

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
    """The same workers, spec for spec, but for the wire's fingerprint (homepd's version), and step costs fitted on
    the same KV term (``Calibration.kv_feature``)."""
    if len(a.workers) != len(b.workers) or a.kv_feature != b.kv_feature:
        return False
    return all(wa.name == wb.name and dataclasses.replace(wa.spec, wire="") == dataclasses.replace(wb.spec, wire="")
               for wa, wb in zip(a.workers, b.workers))


def recent_runs(store, run_id: int | None, hardware: dict | None, now: dt.datetime) -> list[Run]:
    """The complete runs of this box (``box_identity``) other than ``run_id`` that started within ``MAX_AGE`` of
    ``now`` and hold a recommendation, newest first: what a campaign reads from the store once, for every
    candidate's ``earlier_calibrations``."""
    box = box_identity(hardware)
    if store is None or box is None:
        return []
    runs = []
    for row in store.list_runs(limit=N_RUNS_LOOKED_AT):
        if row["id"] == run_id or row["status"] != "complete" or not row["candidates"]:
            continue
        started = _parse_time(row.get("started_at"))
        if started is None or now - started > MAX_AGE:
            continue
        try:
            run = store.load_run(row["id"], timelines=False)
        except (RecordShapeError, RunNotFoundError) as e:  # a row an older homepd wrote that no longer decodes
            log.info("run %s not pooled: %s", row["id"], e)
            continue
        if box_identity(run.hardware) == box and run.advice is not None:
            runs.append(run)
    return runs


def earlier_calibrations(runs: list[Run], candidate: str, cal: Calibration,
                         limit: int = MAX_EARLIER) -> list[tuple[int, Calibration]]:
    """Up to ``limit`` (run id, calibration) of ``candidate`` from ``runs`` (``recent_runs``, newest first) whose
    burst was quiet (``Calibration.disturbed``) and confirmed by its checks (``drift``), and whose workers are
    ``same_workers`` as ``cal``'s."""
    found: list[tuple[int, Calibration]] = []
    for run in runs:
        twin = run.advice.twin(candidate)
        if len(found) < limit and twin is not None and not twin.calibration.disturbed and \
                drift(twin.checks) is None and same_workers(twin.calibration, cal):
            found.append((run.id, twin.calibration))
    return found


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.timezone.utc)
