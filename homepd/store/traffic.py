"""The ``traffic`` table: the shape of every request ``homepd serve`` served, for ``advise --traffic``.

One row per request (``RecordedRequest``'s fields), written in batches by the
service's recorder thread, each batch one transaction.  Bounded: ``prune``
keeps at most ``max_rows`` rows and none older than ``max_age_days``.

    add_traffic(store, requests) -> int          # rows written
    prune_traffic(store, max_rows, max_age_days, now_unix_s=None) -> int   # rows deleted
    traffic_since(store, since_unix_s, until_unix_s=None) -> list[RecordedRequest]
    traffic_extent(store) -> (n_rows, first_unix_s, last_unix_s)
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Iterable

from homepd.measure.trace.traffic import RecordedRequest

_FIELDS = tuple(f.name for f in dataclasses.fields(RecordedRequest))
SECONDS_PER_DAY = 86_400.0


def add_traffic(store, requests: Iterable[RecordedRequest]) -> int:
    """Write ``requests`` in one transaction; return how many."""
    rows = [{k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(r).items()}
            for r in requests]
    if rows:
        with store._lock, store.db.atomic():
            store.db["traffic"].insert_all(rows)
    return len(rows)


def prune_traffic(store, max_rows: int, max_age_days: float, now_unix_s: float | None = None) -> int:
    """Delete the rows older than ``max_age_days`` and all but the newest ``max_rows``; return how many."""
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    with store._lock, store.db.atomic():
        before = store.db.execute("SELECT count(*) FROM traffic").fetchone()[0]
        store.db.execute("DELETE FROM traffic WHERE arrived_unix_s < ?",
                         [now_unix_s - max_age_days * SECONDS_PER_DAY])
        store.db.execute("DELETE FROM traffic WHERE id NOT IN (SELECT id FROM traffic ORDER BY arrived_unix_s DESC, "
                         "id DESC LIMIT ?)", [max_rows])
        after = store.db.execute("SELECT count(*) FROM traffic").fetchone()[0]
    return before - after


def traffic_since(store, since_unix_s: float, until_unix_s: float | None = None) -> list[RecordedRequest]:
    """The recorded requests that arrived in [since, until), in order of arrival."""
    until = float("inf") if until_unix_s is None else until_unix_s
    with store._lock:
        rows = store.db.execute(
            f"SELECT {', '.join(_FIELDS)} FROM traffic WHERE arrived_unix_s >= ? AND arrived_unix_s < ? "
            "ORDER BY arrived_unix_s, id", [since_unix_s, until]).fetchall()
    return [RecordedRequest(**dict(zip(_FIELDS, row))) for row in rows]


def traffic_extent(store) -> tuple[int, float | None, float | None]:
    """(rows, first arrival, last arrival) of the whole table (Unix seconds; None when empty)."""
    with store._lock:
        return tuple(store.db.execute("SELECT count(*), min(arrived_unix_s), max(arrived_unix_s) FROM traffic")
                     .fetchone())
