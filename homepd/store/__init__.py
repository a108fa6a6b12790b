"""The run database: every measurement homepd makes, kept as evidence (the only user of sqlite).

A SQLite file (``default_db_path()``: ``$HOMEPD_DB``, else
``$XDG_DATA_HOME/homepd/homepd.db``, else ``~/.local/share/homepd/homepd.db``)
written through sqlite-utils, in WAL mode, by one writer; every write is one
transaction.  The schema is a list of sqlite-utils migrations
(``homepd.store.schema``) applied on open.

Tables: ``runs`` (kind, status, wall times, writer pid, homepd version,
hardware / configuration / trace JSON), ``results`` (one per candidate x prompt
mix x repeat: flattened metrics for querying plus the ``RunRecord`` JSON, or an
infeasible candidate with its reason), ``requests`` (per-request timelines,
token times included), ``steps`` (at most ``MAX_STEPS_PER_RESULT`` steps per
result, evenly sampled) and ``recommendations``.

API::

    store = Store.open(path=None, create=True)        # or: with Store.open() as store:
    run_id = store.begin_run(kind, config, hardware=None, trace=None)
    store.add_result(run_id, candidate, mix, repeat, record, steps=())   # -> result id
    store.add_infeasible(run_id, candidate, reason, mix=None)            # -> result id
    store.add_recommendation(run_id, data, headline=None)                # -> recommendation id
    store.finish_run(run_id, status="complete", error=None)   # or "incomplete" / "failed"
    with store.recording(kind, config, hardware, trace) as run_id: ...  # begin + finish by outcome
    store.list_runs(limit=20); store.get_run(run_id, timelines=True); store.export_run(run_id)
    store.load_run(run_id, timelines=True) -> Run: the run as typed records (``homepd.store.records``)
    store.resolve_run("last" | id) -> run id; store.mark_abandoned(); store.integrity_check()

A run still ``running`` whose writer process is gone (killed, crashed) is
marked ``incomplete`` on open and whenever runs are read; because each result
is one transaction, such a run holds whole results only.
"""
from homepd.store.errors import RunNotFoundError, StoreError
from homepd.store.paths import default_db_path, results_dir
from homepd.store.rows import MAX_STEPS_PER_RESULT
from homepd.store.store import RUN_STATUSES, Store

__all__ = ["MAX_STEPS_PER_RESULT", "RUN_STATUSES", "RunNotFoundError", "Store", "StoreError", "default_db_path", "results_dir"]
