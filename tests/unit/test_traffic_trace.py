"""Recorded traffic as a trace: the prefix tracker, the replay's lengths / schedule / prefix structure,
rate scaling, SINCE parsing, and the store's traffic table (real sqlite)."""
from __future__ import annotations

import datetime
import random

import pytest

from homepd.engine.prompt import prompt_tokens
from homepd.fakellm import FakeModel
from homepd.measure.trace import TraceError
from homepd.measure.trace.prefixes import BLOCK_TOKENS, PrefixTracker
from homepd.measure.trace.sources import RecordedTraffic, TraceFileSource, parse_since
from homepd.measure.trace.traffic import (RecordedRequest, observed_rate_rps, one_token_units, trace_at_rate,
                                          traffic_trace)
from homepd.store import Store
from homepd.store.traffic import add_traffic, prune_traffic, traffic_extent, traffic_since


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def test_tracker_finds_the_longest_whole_block_prefix_and_its_latest_holder():
    rng = random.Random(1)
    system = ids(rng, 40)                       # 2 whole blocks + 8
    t = PrefixTracker()
    assert t.observe("a", system + ids(rng, 30)).n_tokens == 0
    m = t.observe("b", system + ids(rng, 50))
    assert (m.n_tokens, m.parent_id) == (32, "a")
    m = t.observe("c", system + ids(rng, 5))
    assert (m.n_tokens, m.parent_id) == (32, "b")  # the most recent holder
    assert t.observe("d", ids(rng, 100)).parent_id is None
    assert t.observe("e", system[:BLOCK_TOKENS - 1]).n_tokens == 0  # less than a block is not a prefix


def test_tracker_is_bounded_and_forgets_the_least_recently_seen():
    rng = random.Random(2)
    old, new = ids(rng, 64), ids(rng, 64)
    t = PrefixTracker(max_prefixes=4)
    t.observe("old", old)
    t.observe("new", new)
    assert len(t) == 4
    assert t.observe("again", old).n_tokens == 0
    assert t.observe("again2", new[:32] + ids(rng, 16)).n_tokens == 0  # evicted by "again"'s blocks


def recorded_traffic(seed: int = 3, n: int = 12) -> list[RecordedRequest]:
    """A recording made by the tracker from constructed prompts: conversations that resend their history."""
    rng = random.Random(seed)
    t = PrefixTracker()
    system = ids(rng, 37)
    history: dict[int, list[int]] = {}
    out, now = [], 1_700_000_000.0
    for i in range(n):
        conv = rng.randrange(3)
        prompt = history.get(conv, system) + ids(rng, rng.randrange(5, 90))
        history[conv] = prompt + ids(rng, 7)
        m = t.observe(f"r{i}", prompt)
        now += rng.expovariate(2.0)
        out.append(RecordedRequest(f"r{i}", now, len(prompt), rng.randrange(1, 40),
                                   request_class=rng.choice(["interactive", "background"]),
                                   n_prefix_tokens=m.n_tokens, prefix_parent=m.parent_id))
    return out


@pytest.mark.parametrize("tokenizer", [FakeModel(), None], ids=["fake-tokenizer", "word-units"])
def test_replay_has_the_recorded_schedule_lengths_classes_and_prefix_structure(tokenizer):
    recorded = recorded_traffic()
    assert sum(r.n_prefix_tokens > 0 for r in recorded) >= 6  # the recording has structure to keep
    units = one_token_units(tokenizer)
    trace = traffic_trace(recorded, units=units, seed=7)
    t0 = recorded[0].arrived_unix_s
    assert [r.arrival_s for r in trace] == [round(x.arrived_unix_s - t0, 4) for x in recorded]
    assert [r.max_tokens for r in trace] == [x.n_output_tokens for x in recorded]
    assert [r.request_class for r in trace] == [x.request_class for x in recorded]
    assert all(r.ignore_eos and r.prompt is not None for r in trace)
    if tokenizer is None:
        return
    replayed = [prompt_tokens(tokenizer, r.prompt) for r in trace]
    assert [len(p) for p in replayed] == [x.n_prompt_tokens for x in recorded]
    again = PrefixTracker()
    matches = [again.observe(x.request_id, p) for x, p in zip(recorded, replayed)]
    assert [(m.n_tokens, m.parent_id) for m in matches] == [(x.n_prefix_tokens, x.prefix_parent) for x in recorded]


def test_a_prefix_first_seen_before_the_window_is_fresh_text_and_the_text_follows_the_seed():
    recorded = recorded_traffic()[5:]  # parents of some requests are outside the window
    tok = FakeModel()
    trace = traffic_trace(recorded, units=one_token_units(tok))
    assert [len(prompt_tokens(tok, r.prompt)) for r in trace] == [x.n_prompt_tokens for x in recorded]
    other = traffic_trace(recorded, units=one_token_units(tok), seed=1)
    assert [r.prompt for r in other] != [r.prompt for r in trace]
    assert [r.arrival_s for r in other] == [r.arrival_s for r in trace]


def test_trace_at_rate_scales_the_mean_rate_and_keeps_order_and_relative_gaps():
    trace = traffic_trace(recorded_traffic())
    fast = trace_at_rate(trace, 10.0)
    assert observed_rate_rps(fast) == pytest.approx(10.0, rel=1e-3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    fast_gaps = [b.arrival_s - a.arrival_s for a, b in zip(fast, fast[1:])]
    factor = observed_rate_rps(trace) / 10.0
    assert fast_gaps == pytest.approx([g * factor for g in gaps], abs=2e-4)
    assert [r.prompt for r in fast] == [r.prompt for r in trace]


def test_a_longer_probe_repeats_the_window_with_its_structure_and_fresh_text():
    recorded = recorded_traffic(n=6)
    tok = FakeModel()
    source = RecordedTraffic(tuple(recorded), units=one_token_units(tok))
    trace = source.trace(rate_rps=2.0, n_requests=15)
    assert len(trace) == 15 and observed_rate_rps(trace) == pytest.approx(2.0, rel=1e-3)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(trace, trace[1:]))
    lengths = [len(prompt_tokens(tok, r.prompt)) for r in trace]
    assert lengths == [recorded[k % 6].n_prompt_tokens for k in range(15)]
    assert trace[6].prompt != trace[0].prompt
    tracker = PrefixTracker()
    shares = [tracker.observe(str(k), prompt_tokens(tok, r.prompt)).n_tokens for k, r in enumerate(trace)]
    assert shares[6:12] == [r.n_prefix_tokens if r.prefix_parent else 0 for r in recorded]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_trace_at_rate_refuses_a_rate_that_is_not_positive_and_finite(bad):
    with pytest.raises(TraceError, match="finite number > 0"):
        trace_at_rate(traffic_trace(recorded_traffic()), bad)


def test_trace_at_rate_refuses_a_trace_without_a_rate():
    one = traffic_trace(recorded_traffic()[:1])
    with pytest.raises(TraceError, match="no arrival rate"):
        trace_at_rate(one, 1.0)
    assert len(TraceFileSource(one).trace(n_requests=3)) == 3


def test_parse_since_reads_durations_and_iso_times():
    now = 1_800_000_000.0
    assert parse_since("2h", now) == now - 7200
    assert parse_since("30m", now) == now - 1800
    assert parse_since("1.5d", now) == now - 1.5 * 86400
    assert parse_since("2026-12-01T09:00:00+00:00", now) == datetime.datetime(
        2026, 12, 1, 9, tzinfo=datetime.timezone.utc).timestamp()
    for bad in ("yesterday", "2x", "-2h", ""):
        with pytest.raises(TraceError, match="cannot read SINCE"):
            parse_since(bad, now)


def test_store_keeps_traffic_in_order_and_prunes_by_rows_and_age(tmp_path):
    with Store.open(tmp_path / "h.db") as store:
        rows = recorded_traffic(n=10)
        assert add_traffic(store, reversed(rows)) == 10
        assert [r.request_id for r in traffic_since(store, 0)] == [r.request_id for r in rows]
        assert traffic_since(store, 0)[3] == rows[3]
        middle = rows[4].arrived_unix_s
        assert [r.request_id for r in traffic_since(store, middle)] == [r.request_id for r in rows[4:]]
        assert prune_traffic(store, max_rows=7, max_age_days=1e6) == 3
        assert [r.request_id for r in traffic_since(store, 0)] == [r.request_id for r in rows[3:]]
        now = rows[-1].arrived_unix_s
        cutoff_days = (now - rows[6].arrived_unix_s) / 86400
        assert prune_traffic(store, max_rows=100, max_age_days=cutoff_days, now_unix_s=now) == 3
        n, first, last = traffic_extent(store)
        assert (n, first, last) == (4, rows[6].arrived_unix_s, rows[-1].arrived_unix_s)
