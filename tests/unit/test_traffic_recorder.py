"""The service's traffic recorder on a real sqlite store: rows off the loop, prefix shares, no text unless
asked, and a full database (SQLite's own 'database or disk is full') logged, counted and survived."""
from __future__ import annotations

import time

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.measure.trace.traffic import Route
from homepd.serve.traffic import TrafficRecorder
from homepd.store import Store
from homepd.store.traffic import traffic_since

SYSTEM = list(range(10, 50))  # 40 tokens: two whole blocks shared
NOW = time.time()  # arrivals are recent: the recorder prunes rows older than its retention


def ended(rid: str, n_out: int) -> Lifecycle:
    lc = Lifecycle(request_id=rid, arrived_s=100.0, first_token_s=100.5, ended_s=101.0,
                   finish_reason=FinishReason.LENGTH, n_prompt_tokens=0)
    lc.token_times_s = [100.5 + 0.01 * i for i in range(n_out)]
    return lc


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_rows_carry_shape_prefix_share_and_no_text(tmp_path):
    path = tmp_path / "h.db"
    rec = TrafficRecorder(lambda: Store.open(path), service_id="svc")
    rec.start()
    rec.arrived("a", tuple(SYSTEM + [1, 2, 3]), NOW, Route.CHAT, RequestClass.INTERACTIVE, 64, text="secret words")
    rec.arrived("b", tuple(SYSTEM + [7] * 30), NOW + 1.5, Route.COMPLETIONS, RequestClass.BACKGROUND, 8, text="more secrets")
    rec.ended("b", ended("b", 8))
    rec.ended("a", ended("a", 3))
    rec.stop()
    with Store.open(path) as store:
        rows = traffic_since(store, 0)
    assert [(r.request_id, r.route, r.request_class, r.n_prompt_tokens, r.n_output_tokens, r.max_tokens)
            for r in rows] == [("a", Route.CHAT, RequestClass.INTERACTIVE, 43, 3, 64), ("b", Route.COMPLETIONS, RequestClass.BACKGROUND, 70, 8, 8)]
    assert [(r.n_prefix_tokens, r.prefix_parent) for r in rows] == [(0, None), (32, "a")]
    assert all(r.prompt_text is None and r.finish_reason == "length" and r.service_id == "svc" for r in rows)
    assert rows[1].arrived_unix_s == NOW + 1.5 and rows[1].arrived_at[:19] == time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.gmtime(NOW + 1.5))
    assert rec.n_recorded == 2 and rec.n_write_errors == 0


def test_text_is_kept_only_when_asked(tmp_path):
    path = tmp_path / "h.db"
    rec = TrafficRecorder(lambda: Store.open(path), record_text=True)
    rec.start()
    rec.arrived("a", tuple(SYSTEM), NOW, Route.CHAT, RequestClass.INTERACTIVE, 4, text="hello there")
    rec.ended("a", ended("a", 1))
    rec.stop()
    with Store.open(path) as store:
        assert [r.prompt_text for r in traffic_since(store, 0)] == ["hello there"]


def test_a_full_database_is_counted_and_recording_carries_on(tmp_path):
    path = tmp_path / "h.db"
    store = Store.open(path)
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # no page more: SQLITE_FULL, as on a full disk
    rec = TrafficRecorder(lambda: store, service_id="svc")
    rec.start()
    for i in range(300):  # more than a batch
        rec.arrived(f"r{i}", tuple(SYSTEM + [i]), NOW + i, Route.CHAT, RequestClass.INTERACTIVE, 4)
        rec.ended(f"r{i}", ended(f"r{i}", 2))
    wait_for(lambda: rec.n_write_errors >= 1)
    assert "full" in rec.last_error and rec.n_dropped >= 1 and rec.n_recorded == 0
    store.db.execute("PRAGMA max_page_count = 1073741823")
    rec.arrived("late", tuple(SYSTEM), NOW + 500, Route.CHAT, RequestClass.INTERACTIVE, 4)
    rec.ended("late", ended("late", 2))
    rec.stop()
    with Store.open(path) as check:
        kept = [r.request_id for r in traffic_since(check, 0)]
    assert "late" in kept and rec.n_recorded == len(kept)
    assert rec.n_dropped + rec.n_recorded == 301


def test_rows_older_than_the_retention_are_not_kept(tmp_path):
    path = tmp_path / "h.db"
    rec = TrafficRecorder(lambda: Store.open(path), max_age_days=1.0)
    rec.start()
    for rid, t in (("old", NOW - 2 * 86400), ("new", NOW)):
        rec.arrived(rid, tuple(SYSTEM), t, Route.CHAT, RequestClass.INTERACTIVE, 4)
        rec.ended(rid, ended(rid, 1))
    rec.stop()
    with Store.open(path) as store:
        assert [r.request_id for r in traffic_since(store, 0)] == ["new"]
