"""A campaign's twin search on one mix (``homepd.advise.campaign.twinned.TwinSearch``): the twin's capacity, then
its checks, of which the campaign's budget may drop those after the first.  The constructed calibration of
``test_whatif``; each "measured" probe is the twin's own run of the check's trace (what a check needs of a
probe: its requests' lifecycles), so nothing here is timed."""
from __future__ import annotations

import asyncio

from homepd.advise.campaign.capacity import SearchSettings
from homepd.advise.campaign.twinned import TwinSearch
from homepd.measure.metrics import SLO, summarize
from homepd.measure.replay import RunRecord
from homepd.measure.trace import make_trace
from homepd.twin.check import verdict
from homepd.twin.sim import simulate
from homepd.twin.traces import of_trace

from test_twin import fixed_cost, one_worker
from test_whatif import CONFIG, N_REQUESTS, N_SEEDS, tokenize

CAL = one_worker(CONFIG, fixed_cost(60.0, 1.5, 5.0))
SLO_ = SLO.from_budgets(CONFIG.class_budgets)


def make(rate, n, seed):
    return make_trace("mixed", n, rate, max_tokens=16, long_tokens=120, ignore_eos=True, seed=seed)


def search(n_checks: int, afford, box=CAL, cal=CAL) -> tuple[int, object]:
    """``box``: the calibration the "measured" probes run on (the twin's own: a twin that is right)."""
    probes = []

    async def run_probe(trace, rate, seed):
        probes.append(rate)
        run = simulate(CONFIG, box, of_trace(trace, [tokenize(r) for r in trace]), seed)
        return trace, RunRecord(mode="colocated", config={}, trace_name="mixed", summary=summarize(run.requests, []),
                                stalls=(), worker_events=(), memory=(), kv_arena_bytes=0, energy_j={},
                                requests=tuple(run.requests)), run.steps

    twin = TwinSearch(CONFIG, cal, "mixed", SLO_, (None, None), SearchSettings(), make, tokenize, run_probe,
                      n_checks=n_checks, n_seeds=N_SEEDS, n_requests=N_REQUESTS, steps_per_octave=8,
                      check_requests=8, afford=afford)
    found = asyncio.run(twin.run(1.0))
    return len(probes), found


def test_every_check_runs_while_the_budget_affords_it():
    asked = []
    n, found = search(2, lambda seconds: asked.append(seconds) or True)
    assert n == 2 and len(found.checks) == 2
    assert len(asked) == 1 and asked[0] >= 0.0     # asked once, before the second, with the first's duration


def test_a_check_after_the_first_is_dropped_when_the_budget_is_behind():
    n, found = search(2, lambda seconds: False)
    assert n == 1 and len(found.checks) == 1
    assert found.outcome.curve.capacity_rps is not None   # one check still decides whether the twin is trusted


def test_a_check_spans_at_most_its_span_and_never_fewer_requests_than_a_probe():
    settings = SearchSettings(probe_s=10.0)   # a probe: 10 requests at least (one miss: 10 points)
    capped = TwinSearch(CONFIG, CAL, "mixed", SLO_, (None, None), settings, make, tokenize, None,
                        check_requests=12, check_span_s=20.0)
    assert capped.check_size(1.0) == 12            # 12 arrivals in 11 s
    assert capped.check_size(0.5) == 10            # 10 in 18 s
    assert capped.check_size(0.2) == 10            # 4 would fit 20 s: a probe's 10 still run
    assert capped.check_size(3.0) == 30            # a probe's own length at a high rate (rate x probe_s)
    whole = TwinSearch(CONFIG, CAL, "mixed", SLO_, (None, None), settings, make, tokenize, None,
                       check_requests=12)
    assert whole.check_size(0.2) == 12
    # what the budget reserves for it: its arrivals' span and a tail
    assert capped.check_s(0.5) > 9 / 0.5 and whole.check_s(0.5) > capped.check_s(0.5) and capped.check_s(None) == 0


def test_a_check_after_the_first_runs_where_its_trace_loses_requests_and_a_right_twin_stays_trusted():
    n, found = search(2, lambda seconds: True)
    first, second = found.checks
    assert second.rate_rps > first.rate_rps == found.twin.capacity_rps
    assert max(second.predicted_counts) < second.n_requests      # the twin's draws lose requests there
    assert verdict(found.checks)[0]


def test_a_pessimistic_twin_passes_a_check_at_its_capacity_and_is_refused_by_the_one_above():
    # the twin prices the controller's template and tokenizer at 400 ms a request, which the box does in no time:
    # its steps are priced right (no drift to see), its capacity is too low
    slow = one_worker(CONFIG, fixed_cost(60.0, 1.5, 5.0), prepare_ms=400.0)
    _, alone = search(1, lambda seconds: True, box=CAL, cal=slow)
    assert verdict(alone.checks)[0]          # at the capacity the box meets every request, as the twin says
    _, found = search(2, lambda seconds: True, box=CAL, cal=slow)
    second = found.checks[1]
    assert second.rate_rps > found.twin.capacity_rps and second.measured_met > max(second.predicted_counts)
    assert not verdict(found.checks)[0]
