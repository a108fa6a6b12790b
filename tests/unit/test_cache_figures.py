"""Prefix reuse in the figures: prompt tokens computed vs reused in a run's summary and report, and the
per-worker prefix-cache series of ``/metrics`` built from constructed cache stats."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.terms import ReuseMode
from homepd.core.records import PrefixCacheStats
from homepd.measure.metrics import summarize
from homepd.measure.replay import RunRecord
from homepd.measure.report import render_run
from homepd.serve.metrics import prefix_cache_metrics


def finished(rid: str, n_prompt: int, n_cached: int, t0: float = 0.0) -> Lifecycle:
    lc = Lifecycle(rid, arrived_s=t0, n_prompt_tokens=n_prompt)
    lc.n_cached_tokens = n_cached
    lc.advance(RequestState.PREFILLING, t0 + 0.01)
    lc.advance(RequestState.DECODING, t0 + 0.1)
    lc.add_token(t0 + 0.1)
    lc.add_token(t0 + 0.15)
    lc.advance(RequestState.FINISHED, t0 + 0.15)
    return lc


def test_summary_counts_prompt_tokens_computed_and_reused_over_finished_requests():
    failed = Lifecycle("lost", arrived_s=0.0, n_prompt_tokens=500)
    failed.n_cached_tokens = 400
    failed.advance(RequestState.FAILED, 0.2)
    s = summarize([finished("a", 100, 0), finished("b", 300, 240, 1.0), failed], [])
    assert (s.n_prompt_tokens, s.n_cached_prompt_tokens, s.n_computed_prompt_tokens) == (400, 240, 160)
    assert s.cached_prompt_share == 0.6
    assert summarize([], []).cached_prompt_share is None


def test_run_report_shows_reuse_per_request_and_in_sum():
    requests = (finished("req-first-turn", 100, 0), finished("req-second-turn", 300, 240, 1.0))
    record = RunRecord(mode="colocated", config={}, trace_name="chat", summary=summarize(list(requests), []),
                       stalls=(), worker_events=(), memory=(), kv_arena_bytes=0, energy_j={}, requests=requests)
    text = render_run(record, kinds=["chat", "chat"])
    lines = text.splitlines()
    assert "reused" in lines[0]
    assert lines[2].split()[1:4] == ["chat", "300", "240"]
    assert "prompt tokens: 160 computed, 240 reused from cached prefixes (60%)" in text
    assert record.to_dict()["summary"]["cached_prompt_share"] == 0.6


class _Stats:
    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        return prefix_cache_metrics(self.stats)


def exposition(stats: dict) -> dict:
    registry = CollectorRegistry()
    registry.register(_Stats(stats))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_prefix_cache_series_per_worker_and_the_hit_ratio_only_after_a_lookup():
    stats = {"replica-1": PrefixCacheStats(n_lookups=4, n_hits=3, n_lookup_tokens=1000, n_hit_tokens=750,
                                           n_evictions=2, n_cached_entries=5, n_cached_cells=640,
                                           cached_bytes=7 << 20, n_store_entries=9, store_bytes=30 << 20,
                                           mode=ReuseMode.PREFIX),
             "replica-0": PrefixCacheStats(mode=ReuseMode.EXACT)}
    families = exposition(stats)
    values = {(f.name, s.labels["worker"]): s.value for f in families.values() for s in f.samples
              if f.name != "homepd_prefix_cache_mode"}
    assert {(s.labels["worker"], s.labels["mode"]) for s in families["homepd_prefix_cache_mode"].samples} == \
        {("replica-0", "exact"), ("replica-1", "prefix")}
    assert values[("homepd_prefix_cache_hit_tokens", "replica-1")] == 750
    assert values[("homepd_prefix_cache_evictions", "replica-1")] == 2
    assert values[("homepd_kv_store_bytes", "replica-1")] == 30 << 20
    assert values[("homepd_prefix_cache_bytes", "replica-1")] == 7 << 20
    assert values[("homepd_prefix_cache_hit_ratio", "replica-1")] == 0.75
    assert ("homepd_prefix_cache_hit_ratio", "replica-0") not in values  # nothing looked up: no ratio, not 0
    assert values[("homepd_prefix_cache_lookups", "replica-0")] == 0
    assert all(f.documentation for f in families.values())
    assert exposition({}) == {}  # no worker with a cache: no series at all
