"""The run store: schema and migrations, round trips of constructed records, listing, export, and a
writer killed with SIGKILL mid-run (whole results only, run marked incomplete, file sound)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.protocol import StepRecord
from homepd.core.records import WorkerEvent, WorkerEventKind
from homepd.measure.metrics import SLO, TokenTarget, summarize
from homepd.measure.replay import ProcessMemory, RunRecord
from homepd.measure.stalls import attribute_stalls
from homepd.store import MAX_STEPS_PER_RESULT, RunNotFoundError, Store, StoreError, default_db_path
from homepd.store.rows import sample_evenly
from homepd.store.schema import MIGRATION_NAMES

HERE = Path(__file__).resolve().parent


# ---- constructed records (no model) ---------------------------------------------------------

def make_lifecycle(request_id: str, t0_s: float, n_tokens: int, itl_s: float = 0.02) -> Lifecycle:
    lc = Lifecycle(request_id, arrived_s=t0_s, n_prompt_tokens=40)
    lc.advance(RequestState.PREFILLING, t0_s + 0.01)
    lc.prefill_end_s = t0_s + 0.1
    lc.advance(RequestState.DECODING, t0_s + 0.1)
    for i in range(n_tokens):
        lc.add_token(t0_s + 0.1 + i * itl_s + (0.3 if i == 3 else 0.0))  # one 300 ms stall at token 3
    lc.finish_reason = "length"
    lc.advance(RequestState.FINISHED, lc.token_times_s[-1])
    return lc


def make_steps(n_steps: int, t0_s: float = 100.0) -> list[StepRecord]:
    return [StepRecord("colocated", i, t0_s + i * 0.02, t0_s + i * 0.02 + 0.018, ("r0", "r1"),
                       (("r2", 16),) if i % 5 == 0 else (), kv_in_use=256 + i) for i in range(n_steps)]


def make_record(n_requests: int = 3, n_tokens: int = 6, mode: str = "colocated", trace_name: str = "mixed",
                with_death: bool = False) -> RunRecord:
    requests = tuple(make_lifecycle(f"r{i}", 100.0 + i * 0.05, n_tokens) for i in range(n_requests))
    steps = make_steps(20)
    slo = SLO(ttft_ms=500.0, itl_ms=100.0, token_target=TokenTarget.MEAN_TPOT)
    events = (WorkerEvent(WorkerEventKind.DIED, "colocated", 4242, 100.5, exitcode=-9, cause="killed",
                          recomputed_requests=("r1",)),) if with_death else ()
    return RunRecord(mode=mode, config={"mode": mode, "chunk": 64, "model": Path("/m/x.gguf")},
                     trace_name=trace_name, summary=summarize(list(requests), steps, slo),
                     stalls=tuple(attribute_stalls(list(requests), steps, 100.0)), worker_events=events,
                     memory=(ProcessMemory("colocated", 300 << 20, 200 << 20, 150 << 20),
                             ProcessMemory("controller", 50 << 20, 40 << 20, 30 << 20)),
                     kv_arena_bytes=0, energy_j={"rapl": None}, requests=requests)


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "runs.db") as s:
        yield s


def begin(store: Store, kind: str = "advise") -> int:
    return store.begin_run(kind, config={"slo": {"ttft_ms": 500}}, hardware={"cpu": "2 cores"},
                           trace={"mixes": ["short", "long"]})


# ---- paths, schema, migrations ---------------------------------------------------------------

def test_default_path_is_xdg_data_home_and_homepd_db_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("HOMEPD_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "homepd" / "homepd.db"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "share" / "homepd" / "homepd.db"
    monkeypatch.setenv("HOMEPD_DB", str(tmp_path / "elsewhere.db"))
    assert default_db_path() == tmp_path / "elsewhere.db"


def test_open_without_a_path_creates_the_default_database(monkeypatch, tmp_path):
    monkeypatch.delenv("HOMEPD_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    with Store.open() as s:
        assert s.path == str(tmp_path / "homepd" / "homepd.db")
    assert (tmp_path / "homepd" / "homepd.db").is_file()


def test_migrations_build_every_table_from_an_empty_database_in_wal_mode(tmp_path):
    path = tmp_path / "new.db"
    with Store.open(path) as s:
        assert {"runs", "results", "requests", "steps", "recommendations"} <= set(s.db.table_names())
        assert s.db.journal_mode == "wal"
        assert [r["name"] for r in s.db["_sqlite_migrations"].rows] == MIGRATION_NAMES
        assert s.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_reopening_applies_nothing_twice_and_keeps_the_data(tmp_path):
    path = tmp_path / "again.db"
    with Store.open(path) as s:
        run_id = begin(s)
    for _ in range(2):
        with Store.open(path) as s:
            assert s.db["_sqlite_migrations"].count == len(MIGRATION_NAMES)
            assert s.get_run(run_id)["kind"] == "advise"


def test_a_database_from_a_newer_homepd_is_refused(tmp_path):
    path = tmp_path / "newer.db"
    Store.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                     "VALUES ('homepd.store', '9999_future', 'x')")
    with pytest.raises(StoreError, match="newer homepd"):
        Store.open(path)


def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match=str(path)):
        Store.open(path)


def test_open_without_create_refuses_a_missing_file(tmp_path):
    with pytest.raises(StoreError, match="no run database"):
        Store.open(tmp_path / "missing.db", create=False)
    assert not (tmp_path / "missing.db").exists()


def test_an_in_memory_store_works():
    with Store.open(":memory:") as s:
        run_id = begin(s)
        s.finish_run(run_id)
        assert s.list_runs()[0]["status"] == "complete"


# ---- writing and reading --------------------------------------------------------------------

def test_a_result_round_trips_record_timelines_and_steps(store):
    record = make_record(n_requests=3, with_death=True)
    steps = make_steps(30)
    run_id = begin(store)
    store.add_result(run_id, "colocated-chunk64", "mixed", 0, record, steps)
    run = store.get_run(run_id)
    assert run["hardware"] == {"cpu": "2 cores"} and run["trace"] == {"mixes": ["short", "long"]}
    assert run["status"] == "running" and run["writer_pid"] == os.getpid()
    (result,) = run["results"]
    expected = json.loads(json.dumps(record.to_dict(), default=str))
    got = result["record"]
    assert {k: v for k, v in got.items() if k != "requests"} == {k: v for k, v in expected.items() if k != "requests"}
    assert got["requests"] == [{**r, "token_times_s": lc.token_times_s}
                               for r, lc in zip(expected["requests"], record.requests)]
    assert [s["index"] for s in result["steps"]] == list(range(30))
    assert result["steps"][5]["prefill"] == [["r2", 16]] and result["steps"][5]["n_prompt_tokens"] == 16
    assert [s["kv_in_use"] for s in result["steps"]] == [256 + i for i in range(30)]  # what priced each step


def test_flattened_columns_match_the_summary(store):
    record = make_record(with_death=True)
    run_id = begin(store)
    store.add_result(run_id, "colocated-chunk64", "short", 1, record)
    row = next(store.db["results"].rows)
    s = record.summary
    assert (row["ttft_p99_ms"], row["itl_p99_ms"], row["itl_max_ms"]) == (s.ttft_ms.p99, s.itl_ms.p99, s.itl_ms.max)
    assert row["goodput_per_s"] == s.goodput_per_s and row["slo_attainment"] == s.slo_attainment
    assert row["total_pss_bytes"] == 240 << 20 and row["n_worker_deaths"] == 1
    assert (row["mix"], row["repeat"], row["status"]) == ("short", 1, "measured")
    assert store.db["requests"].count == 3


def test_the_arena_size_keeps_its_old_column_and_json_name_beside_the_new_one(store):
    """kv_arena_bytes was kv_slot_bytes: the released column keeps that name, and the record's JSON has both."""
    record = dataclasses.replace(make_record(), kv_arena_bytes=1 << 20)
    store.add_result(begin(store), "disaggregated", "short", 0, record)
    row = next(store.db["results"].rows)
    assert row["kv_slot_bytes"] == 1 << 20
    body = json.loads(row["record_json"])
    assert body["kv_arena_bytes"] == body["kv_slot_bytes"] == 1 << 20


def test_steps_are_sampled_evenly_down_to_the_limit(store):
    run_id = begin(store)
    n = 3 * MAX_STEPS_PER_RESULT + 7
    store.add_result(run_id, "c", "long", 0, make_record(), make_steps(n))
    row = next(store.db["results"].rows)
    indexes = [s["index"] for s in store.get_run(run_id)["results"][0]["steps"]]
    assert row["n_steps_kept"] == len(indexes) == MAX_STEPS_PER_RESULT
    assert indexes[0] == 0 and indexes[-1] == n - 1 and indexes == sorted(set(indexes))
    gaps = {b - a for a, b in zip(indexes, indexes[1:])}
    assert gaps <= {3, 4}


def test_sample_evenly_keeps_short_lists_whole():
    assert sample_evenly([1, 2, 3], 5) == [1, 2, 3]
    assert sample_evenly(list(range(10)), 3) == [0, 4, 9]
    assert sample_evenly(list(range(10)), 1) == [0]


def test_infeasible_candidates_and_recommendations_are_kept(store):
    run_id = begin(store)
    store.add_infeasible(run_id, "disaggregated", "the model does not fit twice in 1.0 GiB")
    store.add_recommendation(run_id, {"architecture": "colocated", "chunk": 64, "headline": "colocated, chunk 64"})
    run = store.get_run(run_id)
    assert run["results"][0]["status"] == "infeasible"
    assert run["results"][0]["reason"] == "the model does not fit twice in 1.0 GiB"
    assert run["results"][0]["record"] is None
    assert run["recommendations"][0]["data"]["chunk"] == 64
    assert run["recommendations"][0]["headline"] == "colocated, chunk 64"


def test_a_finished_run_takes_no_more_writes(store):
    run_id = begin(store)
    store.finish_run(run_id, "failed", error="the engine refused work")
    with pytest.raises(StoreError, match="is failed"):
        store.add_result(run_id, "c", "short", 0, make_record())
    with pytest.raises(StoreError, match="not 'done'"):
        store.finish_run(run_id, "done")
    assert store.get_run(run_id)["error"] == "the engine refused work"


def test_a_failed_write_leaves_nothing_of_the_result(store):
    run_id = begin(store)
    steps = make_steps(3) + ["not a step"]  # fails once the results and requests rows are written
    with pytest.raises(AttributeError):
        store.add_result(run_id, "c", "short", 0, make_record(), steps)
    assert (store.db["results"].count, store.db["requests"].count, store.db["steps"].count) == (0, 0, 0)


def test_recording_finishes_the_run_by_outcome(store):
    with store.recording("advise", {"x": 1}) as ok:
        pass
    with pytest.raises(RuntimeError):
        with store.recording("advise", {"x": 1}) as bad:
            raise RuntimeError("boom")
    with pytest.raises(KeyboardInterrupt):
        with store.recording("advise", {"x": 1}) as stopped:
            raise KeyboardInterrupt
    statuses = {r["id"]: (r["status"], r["error"]) for r in store.list_runs()}
    assert statuses[ok] == ("complete", None)
    assert statuses[bad] == ("failed", "RuntimeError: boom")
    assert statuses[stopped] == ("incomplete", "KeyboardInterrupt")


def test_list_runs_newest_first_with_candidates_and_recommendation(store):
    first = begin(store, "run")
    store.finish_run(first)
    second = begin(store)
    for cand in ("colocated", "chunk64", "colocated"):
        store.add_result(second, cand, "short", 0, make_record())
    store.add_recommendation(second, {"summary": "chunk64 wins"})
    runs = store.list_runs()
    assert [r["id"] for r in runs] == [second, first]
    assert runs[0]["candidates"] == ["colocated", "chunk64"] and runs[0]["n_results"] == 3
    assert runs[0]["recommendation"] == "chunk64 wins" and runs[1]["recommendation"] is None
    assert [r["id"] for r in store.list_runs(limit=1)] == [second]


def test_resolve_run_takes_an_id_or_last(store):
    with pytest.raises(RunNotFoundError, match="'last'"):
        store.resolve_run("last")
    a, b = begin(store), begin(store)
    assert store.resolve_run("last") == b and store.resolve_run(str(a)) == a
    for bad in ("99", "abc", ""):
        with pytest.raises(RunNotFoundError, match=repr(bad)):
            store.resolve_run(bad)


def test_export_is_json_with_a_format_version(store):
    run_id = begin(store)
    store.add_result(run_id, "c", "short", 0, make_record(), make_steps(4))
    store.finish_run(run_id)
    out = json.loads(json.dumps(store.export_run(run_id)))
    assert (out["format"], out["format_version"], out["id"], out["status"]) == ("homepd-run", 1, run_id, "complete")
    assert len(out["results"][0]["record"]["requests"]) == 3 and len(out["results"][0]["steps"]) == 4


# ---- writers that die ---------------------------------------------------------------------

def test_a_running_run_whose_writer_is_gone_is_marked_incomplete(tmp_path):
    path = tmp_path / "dead.db"
    with Store.open(path) as s:
        live = begin(s)
        dead = begin(s)
        s.db["runs"].update(dead, {"writer_pid": 2 ** 22 + 1})  # above pid_max: no such process
        reused = begin(s)
        s.db["runs"].update(reused, {"writer_start_ticks": -1})  # our pid, but another process's start time
    with Store.open(path) as s:
        status = {r["id"]: r["status"] for r in s.list_runs()}
        assert status == {live: "running", dead: "incomplete", reused: "incomplete"}
        assert "ended without finishing" in s.get_run(dead)["error"]


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from homepd.store import Store
from test_store import make_record, make_steps
store = Store.open({db!r})
run_id = store.begin_run("advise", {{"candidates": ["a"]}})
record, steps = make_record(n_requests=40, n_tokens=50), make_steps(3000)
n_whole = 0

def tracer(sql, params):
    # inside the 4th result, after its results and requests rows: say so, then wait to be killed
    if n_whole == 3 and sql.startswith('INSERT INTO "steps"'):
        print(f"mid-result {{run_id}}", flush=True)
        sys.stdin.readline()

with store.db.tracer(tracer):
    while True:
        store.add_result(run_id, "cand", "mixed", n_whole, record, steps)
        n_whole += 1
        print(f"wrote {{n_whole}}", flush=True)
"""


def test_kill_9_of_a_writer_mid_run_leaves_a_sound_database_with_the_run_incomplete(tmp_path):
    path = tmp_path / "killed.db"
    child = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(HERE), db=str(path))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [child.stdout.readline() for _ in range(4)]
        assert lines[:3] == ["wrote 1\n", "wrote 2\n", "wrote 3\n"] and lines[3].startswith("mid-result "), \
            (lines, child.stderr.read() if child.poll() is not None else "")
        run_id = int(lines[3].split()[1])
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            pipe.close()
    with Store.open(path) as s:
        assert s.integrity_check() == "ok"
        run = s.get_run(run_id, timelines=False)
        assert run["status"] == "incomplete"
        assert [r["repeat"] for r in run["results"]] == [0, 1, 2]  # the 4th, cut mid-write, left nothing
        assert s.db["requests"].count == 3 * 40 and s.db["steps"].count == 3 * MAX_STEPS_PER_RESULT
