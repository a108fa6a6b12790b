"""The memory planner of several models (``homepd.models.planner``) on constructed states: what fits, who is
evicted (the cheapest reload per byte, never a pinned, busy or loading model), when a load waits and when a
model cannot fit at all, and the estimate's margin."""
from __future__ import annotations

import pytest

from homepd.models.planner import (ESTIMATE_MARGIN, WORKER_OVERHEAD_BYTES, PlanKind, Resident, estimate_bytes,
                                   eviction_cost, plan_load)

MB = 1_000_000
NOW = 10_000.0


def idle(name: str, mb: int, **kw) -> Resident:
    return Resident(name, mb * MB, **{"reload_s": 2.0, "last_used_s": NOW - 60, "n_uses": 3, **kw})


def test_two_models_with_room_for_both_fit_without_eviction():
    plan = plan_load("b", 400 * MB, [idle("a", 400)], 1000 * MB, NOW)
    assert plan.kind is PlanKind.FITS and plan.victims == () and plan.free_bytes == 600 * MB


def test_a_budget_that_holds_one_evicts_the_other_and_says_the_bytes():
    plan = plan_load("b", 420 * MB, [idle("a", 400)], 730 * MB, NOW)
    assert plan.kind is PlanKind.EVICT and plan.victims == ("a",) and plan.freed_bytes == 400 * MB
    assert plan.describe("b") == "evicting a to fit b: 420 MB needed, 330 MB free (400 MB freed)"


def test_a_pinned_model_is_never_the_victim_even_when_cheapest():
    residents = [idle("pinned", 100, is_pinned=True, reload_s=0.1, n_uses=0, last_used_s=0.0), idle("b", 300)]
    plan = plan_load("c", 300 * MB, residents, 500 * MB, NOW)
    assert plan.kind is PlanKind.EVICT and plan.victims == ("b",)


def test_a_model_with_requests_in_flight_or_loading_is_not_evicted_the_load_waits():
    for busy in (idle("a", 400, n_in_flight=1), idle("a", 400, is_loading=True)):
        plan = plan_load("b", 400 * MB, [busy], 600 * MB, NOW)
        assert plan.kind is PlanKind.WAIT and plan.victims == ()


def test_a_model_larger_than_the_budget_is_too_large_with_the_bytes():
    plan = plan_load("huge", 2000 * MB, [], 1000 * MB, NOW)
    assert plan.kind is PlanKind.TOO_LARGE and plan.needed_bytes == 2000 * MB and plan.budget_bytes == 1000 * MB
    assert "2,000 MB needed, the budget is 1,000 MB" in plan.describe("huge")


def test_what_pinned_models_hold_counts_against_fitting_at_all():
    plan = plan_load("b", 500 * MB, [idle("p", 600, is_pinned=True)], 1000 * MB, NOW)
    assert plan.kind is PlanKind.TOO_LARGE  # waiting would never help: the pinned model stays


def test_the_cheapest_reload_per_byte_goes_first():
    # a slow-to-load model used often and just now stays; a quick one idle for an hour goes
    residents = [idle("hot", 300, reload_s=8.0, n_uses=50, last_used_s=NOW - 5),
                 idle("cold", 300, reload_s=1.0, n_uses=2, last_used_s=NOW - 3600)]
    plan = plan_load("new", 300 * MB, residents, 700 * MB, NOW)
    assert plan.victims == ("cold",)


def test_recency_and_frequency_each_raise_the_cost():
    base = idle("a", 300, n_uses=3, last_used_s=NOW - 600)
    assert eviction_cost(idle("a", 300, n_uses=30, last_used_s=NOW - 600), NOW, 300 * MB) > eviction_cost(
        base, NOW, 300 * MB)
    assert eviction_cost(idle("a", 300, n_uses=3, last_used_s=NOW - 1), NOW, 300 * MB) > eviction_cost(
        base, NOW, 300 * MB)


def test_a_larger_victim_frees_more_for_its_reload_than_a_small_one():
    residents = [idle("small", 100), idle("large", 400)]
    plan = plan_load("new", 400 * MB, residents, 800 * MB, NOW)
    assert plan.victims == ("large",) and plan.freed_bytes == 400 * MB


def test_victims_a_later_pick_made_unnecessary_are_given_back():
    # greedy by cost per byte takes "cheap" (100 MB) first, then "big" (500 MB), which alone suffices
    residents = [idle("cheap", 100, reload_s=0.1), idle("big", 500, reload_s=1.0)]
    plan = plan_load("new", 450 * MB, residents, 650 * MB, NOW)
    assert plan.kind is PlanKind.EVICT and plan.victims == ("big",)


def test_several_victims_when_one_is_not_enough():
    residents = [idle("a", 200), idle("b", 200), idle("c", 200, is_pinned=True)]
    plan = plan_load("new", 350 * MB, residents, 650 * MB, NOW)
    assert plan.kind is PlanKind.EVICT and set(plan.victims) == {"a", "b"} and plan.freed_bytes == 400 * MB


def test_a_model_already_resident_is_a_bug_of_the_caller():
    with pytest.raises(AssertionError):
        plan_load("a", MB, [idle("a", 1)], 10 * MB, NOW)


def test_the_estimate_counts_weights_once_kv_per_cell_and_each_worker_with_its_margin():
    one = estimate_bytes(100 * MB, 1000, 4096, n_workers=1)
    assert one == int((100 * MB + 4096 * 1000 + WORKER_OVERHEAD_BYTES) * ESTIMATE_MARGIN)
    two = estimate_bytes(100 * MB, 1000, 8192, n_workers=2, shared_bytes=64 * MB)
    assert two - int((100 * MB + 8192 * 1000 + 2 * WORKER_OVERHEAD_BYTES) * ESTIMATE_MARGIN) == 64 * MB
