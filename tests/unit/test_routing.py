"""Cache-aware routing on constructed loads (no processes): replicas go to the replica holding the prompt's
longest prefix unless its queue breaks the TTFT budget; disaggregated routes on each side's uncached tokens;
the controller's per-worker index is fed and corrected as the controller feeds it."""
from __future__ import annotations

import pytest

from homepd.config import EngineConfig
from homepd.core.admission import RouteState, route
from homepd.core.terms import RequestClass, ReuseMode, StepEstimate
from homepd.core.lifecycle import Lifecycle
from homepd.core.modes import Mode, Role
from homepd.core.protocol import StepRecord, WorkerSpec
from homepd.core.records import PrefixCacheStats
from homepd.core.records import AdmissionSnapshot, from_plain, to_plain
from homepd.core.routing import MIN_PREFIX_GAIN_TOKENS, ReplicaView, RouteReason, choose_replica
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import MIN_PROMPT_STEPS, AdmissionGate, WorkerLoad
from homepd.engine.topology import topology_for

I = RequestClass.INTERACTIVE
# 10 ms a step, 2 ms a prompt token: at chunk 64, 64 / 138 ms = 464 prompt tokens/s beside no decodes
EST = StepEstimate(base_ms=10.0, ms_per_prompt_token=2.0, ms_per_decode_token=5.0, ms_per_kv_ktoken=0.0,
                   n_steps=20, error_ms=0.0, n_prompt_steps=MIN_PROMPT_STEPS)
FAST = StepEstimate(**{**EST.__dict__, "ms_per_prompt_token": 1.0})  # 64 / 74 ms = 865 tokens/s


class Handle:
    """What routing reads of a worker handle."""

    def __init__(self, name, role=Role.COLOCATED, in_flight=(), n_ctx=16384, cache_stats=None, n_threads=1):
        self.role, self.failed, self.ready, self.in_flight = name, None, object(), set(in_flight)
        self.spec = WorkerSpec(role=role, model_path="fake", n_ctx=n_ctx, n_seq_max=4, chunk=64,
                               n_threads=n_threads, backend="fake")
        self.cache_stats = cache_stats


def conversation(n, start=0):
    return list(range(start, start + n))


def gate_with(**estimates):
    gate = AdmissionGate(EngineConfig(backend="fake", ttft_budget_ms=4000.0))
    for worker, est in estimates.items():
        gate.observe(worker, StepRecord(worker, 1, 0.0, 0.1, (), (("r", 8),), budget=64), est)
    return gate


def queued(tokens=0, n_decode=0):
    return WorkerLoad({I: tokens} if tokens else {}, {I: 1} if tokens else {}, n_decode, n_decode)


# the pure rule -------------------------------------------------------------------------------------------
def view(name, cached, rank, ttft=None):
    return ReplicaView(name, cached, (rank, name), ttft)


def test_the_replica_holding_the_longest_prefix_wins_within_the_budget():
    got = choose_replica([view("a", 1000, 1, 500.0), view("b", 0, 0, 2000.0)], 4000.0)
    assert (got.name, got.reason, got.n_cached_tokens) == ("a", RouteReason.PREFIX_HIT, 1000)


def test_no_prefix_worth_the_name_goes_to_the_least_loaded():
    # every replica holds the chat template's head; a few more tokens do not pull the request
    got = choose_replica([view("a", 20 + MIN_PREFIX_GAIN_TOKENS - 1, 1), view("b", 20, 0)], 4000.0)
    assert (got.name, got.reason, got.n_cached_tokens) == ("b", RouteReason.LEAST_LOADED, 20)
    got = choose_replica([view("a", 0, 1), view("b", 0, 0)], 4000.0)
    assert (got.name, got.reason) == ("b", RouteReason.LEAST_LOADED)


def test_a_holder_that_would_break_the_ttft_budget_gives_way_to_the_least_loaded():
    got = choose_replica([view("a", 1000, 3, 4500.0), view("b", 0, 0, 2300.0)], 4000.0)
    assert (got.name, got.reason, got.n_cached_tokens) == ("b", RouteReason.TTFT_BUDGET, 0)


def test_a_holder_over_budget_keeps_the_request_when_moving_it_would_be_later_still():
    got = choose_replica([view("a", 1000, 3, 4500.0), view("b", 0, 0, 8700.0)], 4000.0)
    assert (got.name, got.reason) == ("a", RouteReason.PREFIX_HIT)


def test_an_unmeasured_holder_is_trusted_and_equal_holders_split_by_load():
    assert choose_replica([view("a", 1000, 3), view("b", 0, 0)], 4000.0).name == "a"
    got = choose_replica([view("a", 500, 2), view("c", 500, 1), view("b", 0, 0)], 4000.0)
    assert (got.name, got.reason) == ("c", RouteReason.PREFIX_HIT)


# replicas: the topology, the gate's prediction and the controller's index together ---------------------------
def replicas_route(affinity, handles, loads, ids, gate):
    workers = {h.role: h for h in handles}
    return topology_for(Mode.REPLICAS).route_new(
        EngineConfig(backend="fake", mode="replicas"), workers, None, gate, lambda h: loads.get(h.role, queued()),
        len(ids), cached=lambda h: affinity.cached(h, ids), request_class=I)


def test_a_conversations_next_turn_goes_to_the_replica_that_served_it_until_its_queue_breaks_the_budget():
    a, b = Handle("replica-0"), Handle("replica-1")
    affinity, gate = PrefixAffinity(), gate_with(**{"replica-0": EST, "replica-1": EST})
    turn1 = conversation(1000)
    affinity.holds(a, turn1)                      # turn 1 was sent there and finished there
    turn2 = turn1 + conversation(30, start=5000)
    routed = replicas_route(affinity, [a, b], {}, turn2, gate)
    assert (routed.worker, routed.reason, routed.n_cached_tokens) == (a, RouteReason.PREFIX_HIT, 1000)
    # 2000 tokens queued on replica-0: (2000 + 30) / 464 tok/s = 4.4 s > 4 s; replica-1: 1030 / 464 = 2.2 s
    a.in_flight = {"doc"}
    routed = replicas_route(affinity, [a, b], {"replica-0": queued(2000)}, turn2, gate)
    assert (routed.worker, routed.reason, routed.n_cached_tokens) == (b, RouteReason.TTFT_BUDGET, 0)
    # a fresh prompt: the least loaded
    routed = replicas_route(affinity, [a, b], {"replica-0": queued(2000)}, conversation(40, start=9000), gate)
    assert (routed.worker, routed.reason) == (b, RouteReason.LEAST_LOADED)


def test_a_replica_whose_cache_is_off_is_never_credited_with_a_prefix():
    a, b = Handle("replica-0", in_flight={"x"}, cache_stats=PrefixCacheStats(mode=ReuseMode.OFF)), Handle("replica-1")
    affinity = PrefixAffinity()
    affinity.holds(a, conversation(1000))
    routed = replicas_route(affinity, [a, b], {}, conversation(1030), gate_with())
    assert (routed.worker, routed.reason) == (b, RouteReason.LEAST_LOADED)
    a.cache_stats = PrefixCacheStats(mode=ReuseMode.PREFIX)  # the same replica with a prefix cache pulls it
    routed = replicas_route(affinity, [a, b], {}, conversation(1030), gate_with())
    assert (routed.worker, routed.reason) == (a, RouteReason.PREFIX_HIT)


# disaggregated --------------------------------------------------------------------------------------------
def disagg_route(affinity, prefill, decode, ids, gate, decode_load=None):
    workers = {Role.PREFILL.value: prefill, Role.DECODE.value: decode}
    loads = {prefill.role: queued(), decode.role: decode_load or queued(n_decode=1)}
    return topology_for(Mode.DISAGGREGATED).route_new(
        EngineConfig(backend="fake", mode="disaggregated"), workers, None, gate, lambda h: loads[h.role],
        len(ids), cached=lambda h: affinity.cached(h, ids), request_class=I)


def test_disaggregated_routes_on_uncached_tokens_a_short_followup_stays_on_the_decode_worker():
    prefill, decode = Handle("prefill", Role.PREFILL, n_threads=2), Handle("decode", Role.DECODE)
    gate = gate_with(prefill=FAST, decode=EST)
    affinity = PrefixAffinity()
    # a 1030-token prompt nobody holds: 2.3 s on the decode worker beside its stream, 1.2 s through the prefill one
    fresh = conversation(1030)
    routed = disagg_route(affinity, prefill, decode, fresh, gate)
    assert (routed.worker, routed.reason, routed.n_cached_tokens) == (prefill, RouteReason.SOONER, 0)
    # turn 1 went through the prefill worker (it keeps the prompt) and was handed off (the decode worker holds
    # the prompt, then prompt + output when it finished)
    turn1, answer = conversation(1000), conversation(50, start=3000)
    affinity.holds(prefill, turn1)
    affinity.holds(decode, turn1 + answer)
    turn2 = turn1 + answer + conversation(30, start=5000)
    routed = disagg_route(affinity, prefill, decode, turn2, gate)
    assert (routed.worker, routed.reason, routed.n_cached_tokens) == (decode, RouteReason.PREFIX_HIT, 1050)
    assert gate.routed["local"] == 1 and gate.routed["remote"] == 1
    # a long new document after the same history: through the prefill worker, which reuses its 1000 tokens
    turn3 = turn1 + answer + conversation(2000, start=7000)
    routed = disagg_route(affinity, prefill, decode, turn3, gate)
    assert (routed.worker, routed.reason, routed.n_cached_tokens) == (prefill, RouteReason.SOONER, 1000)


def test_the_pure_route_rule_counts_only_uncached_tokens_on_each_side():
    s = RouteState(prefill_queue_tokens=0, prefill_tok_s_prefill=1000.0, prefill_tok_s_decode=400.0,
                   handoff_ms_per_token=0.1, handoff_base_ms=10.0, max_local_tokens=4096)
    assert not route(1000, s).on_decode_worker  # 2500 ms here, 1110 ms there
    held = route(1000, RouteState(**{**s.__dict__, "cached_local_tokens": 950}))
    assert held.on_decode_worker and held.predicted_local_ms == pytest.approx(50 / 400 * 1e3)
    both = route(1000, RouteState(**{**s.__dict__, "cached_local_tokens": 500, "cached_remote_tokens": 990}))
    # 500 uncached here (1250 ms) against 10 there (10 + 10 + 100 ms of handoff for the whole prompt)
    assert not both.on_decode_worker and both.predicted_remote_ms == pytest.approx(10 + 10 + 100)


# what the controller feeds the index, and how the worker's real reuse corrects it --------------------------------
def lifecycle(routed_to, expected, reused):
    return Lifecycle("r", 0.0, routed_to=routed_to, route_reason=RouteReason.PREFIX_HIT.value,
                     route_cached_tokens=expected, n_cached_tokens=reused)


def test_a_worker_that_reused_less_than_expected_ages_out_that_many_old_tokens():
    a = Handle("replica-0", cache_stats=PrefixCacheStats(mode=ReuseMode.PREFIX))
    affinity = PrefixAffinity()
    old, conv = conversation(300, start=10_000), conversation(500)
    affinity.holds(a, old)
    affinity.holds(a, conv)
    done = conv + conversation(20, start=900)
    affinity.ended(a, lifecycle("replica-0", 500, 200), done, {"replica-0": a})
    assert affinity.cached(a, old) == 0 and affinity.cached(a, done + [7]) == 520  # the oldest went, not this
    assert affinity.n_corrected_tokens == 300


def test_without_a_reported_cache_a_miss_corrects_nothing_and_a_dead_worker_forgets_everything():
    a = Handle("replica-0")  # no PrefixCacheStats yet: nothing is reported reused, so a miss says nothing
    affinity = PrefixAffinity()
    affinity.holds(a, conversation(300, start=10_000))
    affinity.ended(a, lifecycle("replica-0", 500, 0), conversation(520), {"replica-0": a})
    assert affinity.cached(a, conversation(301, start=10_000)) == 300 and affinity.n_corrected_tokens == 0
    affinity.forget(a)
    assert affinity.cached(a, conversation(520)) == 0


def test_the_index_budget_is_the_workers_context():
    a = Handle("replica-0", n_ctx=1024)
    affinity = PrefixAffinity()
    for i in range(5):
        affinity.holds(a, conversation(400, start=1000 * i))
    assert len(affinity.index(a)) <= 1024 and affinity.cached(a, conversation(401, start=4000)) == 400


def test_the_snapshot_counts_routing_decisions_by_reason_and_scores_the_predictions():
    gate = gate_with()
    for reason in (RouteReason.PREFIX_HIT, RouteReason.PREFIX_HIT, RouteReason.TTFT_BUDGET):
        gate.note_route(reason)
    gate.finished(lifecycle("replica-0", 500, 480))
    snap = gate.snapshot(queued(), {})
    assert snap.routed_by_reason == {"prefix_hit": 2, "ttft_budget": 1}
    assert (snap.route_predicted_cached_tokens, snap.route_reused_tokens) == (500, 480)
    assert from_plain(AdmissionSnapshot, to_plain(snap)) == snap


def test_a_few_tokens_short_is_the_workers_granularity_not_aging_and_the_last_token_is_never_credited():
    a = Handle("replica-0", cache_stats=PrefixCacheStats(mode=ReuseMode.PREFIX))
    affinity = PrefixAffinity()
    old, conv = conversation(300, start=10_000), conversation(500)
    affinity.holds(a, old)
    affinity.holds(a, conv)
    assert affinity.cached(a, conv) == 499  # the same prompt again: its last token is computed anyway
    affinity.ended(a, lifecycle("replica-0", 499, 499 - MIN_PREFIX_GAIN_TOKENS + 1), conv, {"replica-0": a})
    assert affinity.cached(a, old) == 299 and affinity.n_corrected_tokens == 0
