"""The capacity search on constructed attainment-vs-rate functions: it finds the edge to its resolution,
keeps to its rule under non-monotone noise, stops at its probe budget, and a quick search and a full one on
the same curves cannot disagree outside the quick answer's interval."""
from __future__ import annotations

import math

import pytest

from homepd.advise.campaign.capacity import (CapacitySearch, Probe, SearchSettings, answer_interval, combine, grid_rate,
                                    probe_requests, start_rate_rps, within_spread)
from homepd.core.records import to_plain

QUICK = SearchSettings(steps_per_octave=2, grow_steps=2, max_probes=8, time_budget_s=1e9)
FULL = SearchSettings(steps_per_octave=8, grow_steps=8, max_probes=16, time_budget_s=1e9)


def step_at(edge_rps: float):
    """Every request meets the SLO up to ``edge_rps``, a third of them above (a monotone curve)."""
    return lambda rate, seed: 1.0 if rate <= edge_rps else 2 / 3


def search(attainment, start_rps: float, settings: SearchSettings, seed: int = 0, name: str = "c"):
    s = CapacitySearch(start_rps, settings)
    while (rate := s.next_rate()) is not None:
        n = probe_requests(rate, settings)
        a = attainment(rate, seed)
        s.record(Probe(rate, n, a, a * rate, seed, n / rate, {"interactive": a},
                       {} if a >= settings.target_share else {"every gap <= 100 ms": round((1 - a) * n)}))
    return s.curve(name, "mixed")


@pytest.mark.parametrize("edge", [0.13, 0.37, 0.5, 1.0, 2.9, 11.0])
@pytest.mark.parametrize("start", [0.05, 0.4, 3.0, 40.0])
def test_finds_the_edge_to_its_resolution_from_any_start(edge, start):
    curve = search(step_at(edge), start, FULL)
    ratio = 2 ** (1 / FULL.steps_per_octave)
    assert curve.capacity_rps <= edge < curve.capacity_rps * ratio + 1e-9   # the grid point just below the edge
    assert curve.spread_rps == pytest.approx(curve.capacity_rps * (ratio - 1))
    assert curve.resolution_rps == pytest.approx(curve.capacity_rps * (ratio - 1))
    assert curve.decided_by == "every gap <= 100 ms"
    assert len(curve.probes) <= FULL.max_probes


def test_probes_lie_on_the_grid_and_never_repeat_a_rate():
    curve = search(step_at(0.7), 0.3, FULL)
    ks = [math.log2(p.rate_rps) * FULL.steps_per_octave for p in curve.probes]
    assert all(k == pytest.approx(round(k)) for k in ks) and len(set(round(k) for k in ks)) == len(ks)


def test_a_pass_above_a_failure_never_raises_the_capacity():
    # noise: a failing probe at 1.0 req/s although 1.19 and 1.41 pass; the true edge is 2.0
    noisy = lambda rate, seed: 0.5 if abs(rate - 1.0) < 1e-9 else (1.0 if rate <= 2.0 else 0.5)
    s = CapacitySearch(1.0, SearchSettings(steps_per_octave=4, grow_steps=4, max_probes=8, time_budget_s=1e9))
    for rate in (1.0, 2.0, 1.41):   # as if the search had been told these (1.41 passes above the 1.0 failure)
        s.record(Probe(rate, 10, noisy(rate, 0), None, 0, 10 / rate, {}))
    curve = s.curve("c", "mixed")
    # the rule: the highest passing rate *below the lowest failing one*; none is below 1.0
    assert curve.capacity_rps is None
    assert s.next_rate() == pytest.approx(grid_rate(-4, 4))   # so it looks below the failure: 0.5 req/s
    s.record(Probe(0.5, 10, 1.0, None, 0, 20, {}))
    s.record(Probe(grid_rate(-2, 4), 10, 1.0, None, 0, 10, {}))   # 0.71 passes
    s.record(Probe(grid_rate(-1, 4), 10, 1.0, None, 0, 10, {}))   # 0.84 passes
    curve = s.curve("c", "mixed")
    assert curve.capacity_rps == pytest.approx(grid_rate(-1, 4)) and s.next_rate() is None
    assert answer_interval(curve) == pytest.approx((grid_rate(-1, 4), 1.0))
    assert len(curve.probes) == 6   # the passes above the failure stay in the curve


def test_stops_at_its_probe_budget_and_at_its_time_budget():
    settings = SearchSettings(steps_per_octave=16, grow_steps=1, max_probes=3, time_budget_s=1e9)
    curve = search(step_at(10.0), 1.0, settings)
    assert len(curve.probes) == 3 and curve.capacity_rps == pytest.approx(grid_rate(2, 16))
    assert curve.spread_rps is None and "nothing failed" in curve.decided_by   # a lower bound, said so
    timed = SearchSettings(steps_per_octave=4, grow_steps=4, max_probes=50, time_budget_s=35.0)
    curve = search(step_at(0.3), 1.0, timed)   # 12 requests at 1 req/s (12 s), 10 at 0.5 (20 s); 0.25: 40 s more
    assert [p.duration_s for p in curve.probes] == [12.0, 20.0]


def test_a_start_too_slow_for_the_time_budget_is_raised_to_the_slowest_probe_that_fits():
    settings = SearchSettings(steps_per_octave=2, grow_steps=2, max_probes=3, time_budget_s=24.0)
    curve = search(step_at(0.01), 0.001, settings)   # a calibration on a crowded box: a start of 0.001 req/s
    assert min(p.rate_rps for p in curve.probes) >= 10 / 24.0   # 10 requests fit in the 24 s budget
    assert sum(p.duration_s for p in curve.probes) <= 24.0 and curve.capacity_rps is None
    assert answer_interval(curve)[1] == pytest.approx(grid_rate(-2, 2))   # "below 0.5 req/s", honestly


def test_the_rate_range_bounds_the_search():
    settings = SearchSettings(max_rate_rps=4.0, min_rate_rps=0.25, time_budget_s=1e9)
    high = search(step_at(100.0), 1.0, settings)
    assert max(p.rate_rps for p in high.probes) == pytest.approx(4.0) and high.capacity_rps == pytest.approx(4.0)
    low = search(step_at(0.01), 1.0, settings)
    assert low.capacity_rps is None and min(p.rate_rps for p in low.probes) == pytest.approx(0.25)
    assert answer_interval(low) == (0.0, pytest.approx(0.25))


def test_probe_length_one_miss_moves_attainment_by_at_most_the_resolution():
    s = SearchSettings(attainment_resolution=0.1, probe_s=12.0, max_requests=40)
    assert probe_requests(0.1, s) == 10 and probe_requests(2.0, s) == 24 and probe_requests(100.0, s) == 40
    assert probe_requests(0.5, SearchSettings(attainment_resolution=0.05)) == 20


def test_start_rate_from_measured_speeds():
    # 300-token prompts at 1500 tok/s (0.2 s) + 24 tokens at 25 ms (0.6 s): busy at 1.25 req/s, start at half
    assert start_rate_rps(1500.0, 25.0, 300, 24) == pytest.approx(0.625)
    assert start_rate_rps(None, 25.0, 300, 24) == 1.0


def test_repeats_combine_into_a_median_with_their_range_as_spread():
    curves = [search(step_at(edge), 1.0, FULL, seed=i) for i, edge in enumerate((0.9, 1.0, 1.3))]
    both = combine(curves)
    caps = sorted(c.capacity_rps for c in curves)
    assert both.capacity_rps == caps[1] and both.spread_rps == pytest.approx(caps[2] - caps[0])
    assert len(both.probes) == sum(len(c.probes) for c in curves)
    assert {p.seed for p in both.probes} == {0, 1, 2}


@pytest.mark.parametrize("edge", [0.21, 0.44, 0.62, 0.99, 1.7, 3.3])
@pytest.mark.parametrize("start_quick,start_full", [(0.5, 0.5), (0.3, 1.2), (2.0, 0.25)])
def test_quick_and_full_cannot_disagree_outside_the_quick_interval(edge, start_quick, start_full):
    # different start estimates (two calibrations never agree exactly), the same curve; quick repeats once,
    # the full campaign three times
    quick = search(step_at(edge), start_quick, QUICK)
    full = combine([search(step_at(edge), start_full, FULL, seed=i) for i in range(3)])
    low, high = answer_interval(quick)
    assert low <= full.capacity_rps <= high
    assert full.spread_rps < quick.spread_rps   # and it is finer


def test_ties_are_the_capacities_within_each_others_spread():
    a, b = search(step_at(0.8), 1.0, QUICK, name="a"), search(step_at(0.9), 1.0, QUICK, name="b")
    assert a.capacity_rps == b.capacity_rps and within_spread(a, b)   # one grid point: a tie
    c = search(step_at(3.0), 1.0, QUICK, name="c")
    assert not within_spread(a, c)


def test_the_curve_is_plain_json_in_the_agreed_shape():
    plain = to_plain(search(step_at(1.0), 1.0, QUICK))
    assert set(plain) == {"candidate", "mix", "target_share", "resolution_rps", "probes", "capacity_rps",
                          "spread_rps", "decided_by", "interval_rps", "source", "attainment_at_half"}
    assert {"rate_rps", "n_requests", "attainment", "goodput_rps", "seed", "duration_s",
            "per_class"} <= set(plain["probes"][0])


def refine(attainment, coarse, settings: SearchSettings, seed: int = 0):
    s = CapacitySearch(coarse.capacity_rps or 1.0, settings, prior=coarse.probes)
    while (rate := s.next_rate()) is not None:
        n = probe_requests(rate, settings)
        a = attainment(rate, seed)
        s.record(Probe(rate, n, a, a * rate, seed, n / rate, {"interactive": a}, {}))
    return s, s.curve("c", "mixed")


@pytest.mark.parametrize("edge", [0.21, 0.62, 1.7, 3.3])
def test_a_refinement_bisects_on_from_the_coarse_bracket_and_stays_inside_its_interval(edge):
    coarse = search(step_at(edge), 0.5, QUICK)
    s, fine = refine(step_at(edge), coarse, FULL)
    fresh = search(step_at(edge), coarse.capacity_rps, FULL)
    assert fine.probes[:len(coarse.probes)] == coarse.probes        # the screen's probes are its own points
    assert len(fine.probes) - len(coarse.probes) < len(fresh.probes)  # fewer new probes than starting afresh
    low, high = answer_interval(coarse)
    assert low <= fine.capacity_rps <= high and fine.spread_rps < coarse.spread_rps
    assert fine.capacity_rps == fresh.capacity_rps                  # the same edge, to the fine resolution
    # the budget counts its own probes only: a spent coarse budget does not stop the refinement
    tight = SearchSettings(steps_per_octave=8, grow_steps=8, max_probes=2, time_budget_s=1e9)
    s2, _ = refine(step_at(edge), coarse, tight)
    assert len(s2.probes) - len(coarse.probes) <= 2


def test_the_probe_span_lets_one_grid_step_over_the_capacity_build_a_ttft_of_backlog():
    from homepd.advise.campaign.capacity import probe_span_s

    for n, ttft in [(2, 4.0), (4, 4.0), (4, 10.0), (8, 4.0)]:
        span = probe_span_s(ttft, n)
        backlog = (2 ** (1 / n) - 1) * span  # seconds of work left over after ``span`` one step above
        assert ttft <= backlog < ttft + (2 ** (1 / n) - 1)   # enough, and no more than a second longer
    assert (probe_span_s(4.0, 2), probe_span_s(4.0, 4)) == (10.0, 22.0)


def test_a_search_short_of_time_steps_down_by_less_than_it_grows():
    settings = SearchSettings(steps_per_octave=2, grow_steps=2, shrink_steps=1, max_probes=3, time_budget_s=1e9)
    s = CapacitySearch(1.0, settings)
    s.record(Probe(s.next_rate(), 10, 0.5, 0.5, 0, 10, {}))          # 1.0 failed
    assert s.next_rate() == pytest.approx(2 ** -0.5)                   # one step down (x1.41), not two
    s2 = CapacitySearch(1.0, settings)
    s2.record(Probe(s2.next_rate(), 10, 1.0, 1.0, 0, 10, {}))         # 1.0 passed
    assert s2.next_rate() == 2.0                                       # up by two
