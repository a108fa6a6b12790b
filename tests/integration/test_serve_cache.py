"""Prefix reuse as ``homepd serve`` reports it, over real HTTP (fake backend): ``usage.prompt_tokens_details
.cached_tokens`` in every response shape, the per-worker prefix-cache series of ``/metrics`` and the typed cache
stats of ``/status``.

The fake worker runs with the test-only fault ``claim_prefix_hits``: it reports half of each prompt as a reused
prefix (``PrefixReused``, ``StepReport.cache``) without reusing anything, so what is checked here is the path
from the worker's report to each face, not the cache itself (its own tests: the ``prefix`` work).
"""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from homepd.core.records import PrefixCacheStats
from homepd.core.records import EngineSnapshot
from homepd.core.terms import ReuseMode
from test_serve_harness import ServeProcess

pytestmark = pytest.mark.timeout(120)
MODEL = "smollm2-135m-instruct-q4_1"
MESSAGES = [{"role": "user", "content": "What is a sourdough starter made of?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("cache"), "--backend", "fake", "--n-ctx", "512",
                        "--max-tokens", "16", "--fault", "claim_prefix_hits")
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def claimed(usage: dict) -> int:
    """What the fault claims for a prompt: half of it (and the response must say the same)."""
    return usage["prompt_tokens"] // 2


def test_chat_and_completion_usage_carry_cached_tokens(client):
    for route, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "abcdef"})):
        reply = client.post(route, json={"model": MODEL, "max_tokens": 3, **body}).json()
        usage = reply["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": claimed(usage)}, route
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert reply["homepd"]["n_cached_tokens"] == claimed(usage)


@pytest.mark.parametrize("continuous", [False, True])
def test_streamed_usage_carries_cached_tokens(client, continuous):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 4
    assert final["prompt_tokens_details"]["cached_tokens"] == claimed(final) > 0
    if continuous:  # every chunk's usage has the field; once the prefix is known, its value
        details = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks]
        assert details[-1] == claimed(final) and all(d in (0, claimed(final)) for d in details)
        assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == claimed(final)
                   for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
    else:
        assert all(c["usage"] is None for c in chunks[:-1])


def test_metrics_have_prefix_cache_series_per_worker_with_help(client):
    replies = [client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                          "max_tokens": 2}).json() for _ in range(2)]
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("homepd_prefix_cache_lookups", "homepd_prefix_cache_hits", "homepd_prefix_cache_hit_tokens",
                 "homepd_prefix_cache_lookup_tokens", "homepd_prefix_cache_evictions", "homepd_prefix_cache_bytes",
                 "homepd_prefix_cache_entries", "homepd_prefix_cache_hit_ratio", "homepd_kv_store_bytes",
                 "homepd_kv_store_entries", "homepd_prefill_pauses", "homepd_prefill_pause_resumed_tokens"):
        family = families[name]
        assert family.documentation, name
        assert [s.labels for s in family.samples if not s.name.endswith("_created")] == [{"worker": "colocated"}]
    value = {f: families[f].samples[0].value for f in ("homepd_prefix_cache_lookups", "homepd_prefix_cache_hit_tokens",
                                                       "homepd_prefix_cache_lookup_tokens",
                                                       "homepd_prefix_cache_hit_ratio")}
    assert value["homepd_prefix_cache_lookups"] >= 3  # the warm-up and these two at least
    assert value["homepd_prefix_cache_hit_ratio"] == pytest.approx(
        value["homepd_prefix_cache_hit_tokens"] / value["homepd_prefix_cache_lookup_tokens"])
    cached_total = families["homepd_prompt_cached_tokens"].samples[0].value
    assert cached_total >= sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies) > 0


def test_status_carries_typed_cache_stats(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 1})
    engine = EngineSnapshot.from_dict(client.get("/status").json()["engine"])
    stats = engine.cache["colocated"]
    assert isinstance(stats, PrefixCacheStats) and stats.mode is ReuseMode.PREFIX
    assert stats.n_lookups >= 2 and 0 < stats.n_hit_tokens < stats.n_lookup_tokens
