"""What-if on a constructed run: one calibrated colocated candidate whose steps take a fixed time, replayed under
a change (``homepd.advise.whatif.project``), in this process on a few short seeds."""
from __future__ import annotations

import dataclasses

import pytest

from homepd.advise.whatif import WhatIf, project, render
from homepd.config import EngineConfig
from homepd.core.modes import Candidate, Mode
from homepd.errors import ConfigError
from homepd.measure.curve import CapacityCurve
from homepd.store.records import Run, RunAdvice, RunConfig
from homepd.twin.capacity import twin_capacity
from homepd.twin.records import TwinEvidence
from homepd.twin.traces import TWIN_TAG, TraceRequests
from homepd.measure.trace import make_trace
from homepd.measure.trace.model import tagged
from homepd.measure.metrics import SLO

from test_twin import fixed_cost, one_worker

N_SEEDS, N_REQUESTS = 5, 24
CONFIG = EngineConfig(backend="fake", mode="colocated", n_seq_max=4, chunk=64, n_ctx=4096)


def tokenize(r) -> tuple[int, ...]:
    """A word a token (what the twin needs of a prompt: its length and what it shares with others)."""
    text = r.prompt if r.prompt is not None else " ".join(m["content"] for m in r.messages)
    return tuple(sum(map(ord, w)) for w in text.split())


def requests(n_requests: int = N_REQUESTS) -> TraceRequests:
    make = lambda rate, n, seed: tagged(make_trace("mixed", n, rate, max_tokens=16, long_tokens=120,  # noqa: E731
                                                   ignore_eos=True, seed=seed), TWIN_TAG)
    reqs = TraceRequests(make, n_requests, tokenize)
    reqs.prepare(range(N_SEEDS))
    return reqs


@pytest.fixture(scope="module")
def run() -> Run:
    cal = one_worker(CONFIG, fixed_cost(60.0, 1.5, 5.0))
    slo = SLO.from_budgets(CONFIG.class_budgets)
    cap = twin_capacity(CONFIG, cal, requests(), slo, (None, None), 1.0, n_seeds=N_SEEDS, n_requests=N_REQUESTS,
                        processes=1, steps_per_octave=8)
    assert cap.capacity_rps is not None
    # fixed step times, no noise: at half the capacity the load is light and nearly every request meets the SLO
    assert cap.attainment_at_half >= 0.95 and not cap.noise_bound
    name = "colocated-chunk-64"
    twin = TwinEvidence(name, dataclasses.replace(cal, candidate=name), (cap,), trusted=True, why="checked",
                        attainment_error_points=3.0, config=CONFIG)
    cand = Candidate(name, Mode.COLOCATED, chunk=64)
    curve = CapacityCurve(name, "mixed", 0.9, cap.resolution_rps, (), cap.capacity_rps, None, "twin",
                          cap.interval_rps, "twin")
    advice = RunAdvice(candidate=cand, config=cand.config_values(), rule="colocated-best-capacity",
                       capacity=(curve,), candidates=(cand,), twins=(twin,))
    return Run(3, "advise", "complete", RunConfig(max_tokens=16, long_tokens=120), (), advice,
               started_at="2026-12-06T10:00:00")


def test_a_rate_change_keeps_the_runs_capacity_and_projects_the_attainment_at_the_new_rate(run):
    measured = run.advice.twins[0].capacities[0]
    (half,) = project(run, WhatIf(rate_scale=0.5), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1)
    (triple,) = project(run, WhatIf(rate_scale=3.0), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1)
    for p in (half, triple):
        assert p.projected.capacity_rps == measured.capacity_rps and p.projected.wall_s == 0.0
    assert half.reference_rps == pytest.approx(measured.capacity_rps * 0.5)
    assert half.attainment_at_reference >= 0.9 > triple.attainment_at_reference
    text = render(run, WhatIf(rate_scale=3.0), [triple])
    assert text.startswith("projected from run 3's calibration") and "traffic x3" in text
    assert "only the rate changed" in text


def test_a_gap_budget_is_simulated_again_a_looser_one_buys_capacity_a_tighter_one_loses_it(run):
    measured = run.advice.twins[0].capacities[0].capacity_rps
    (loose,) = project(run, WhatIf(itl_budget_ms=200.0), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS,
                       processes=1, max_seeds=N_SEEDS)
    (tight,) = project(run, WhatIf(itl_budget_ms=40.0), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS,
                       processes=1, max_seeds=N_SEEDS)
    assert loose.projected.wall_s > 0 and loose.measured_rps == measured
    # what-if asks for the capacity only: no runs at half of it (the campaign's rule reads those, a projection not)
    assert loose.projected.attainment_at_half is None
    assert loose.projected.capacity_rps > measured
    assert (tight.projected.capacity_rps or 0.0) < measured   # a decode step alone takes 60 ms and more
    assert "gap budget 200 ms" in render(run, WhatIf(itl_budget_ms=200.0), [loose])


def test_seeds_come_in_waves_while_the_time_budget_holds_them(run):
    from homepd.twin.capacity import TARGET_HALF_WIDTH

    what = WhatIf(itl_budget_ms=200.0)
    (spent,) = project(run, what, tokenize, n_seeds=2, n_requests=N_REQUESTS, processes=1, max_seeds=6,
                       budget_s=0.0)
    assert spent.projected.n_seeds == 2          # the first wave always runs, and no more without time
    (free,) = project(run, what, tokenize, n_seeds=2, n_requests=N_REQUESTS, processes=1, max_seeds=6,
                      budget_s=None)
    # every wave, unless the interval narrowed to the campaign's target first
    assert free.projected.n_seeds == 6 or free.projected.half_width <= TARGET_HALF_WIDTH
    assert free.projected.n_seeds > 2 or spent.projected.half_width <= TARGET_HALF_WIDTH


def test_a_run_without_a_twin_names_what_to_run(run):
    bare = dataclasses.replace(run, advice=dataclasses.replace(run.advice, twins=()))
    with pytest.raises(ConfigError, match="no twin calibration.*homepd advise --quick"):
        project(bare, WhatIf(rate_scale=2.0), tokenize)


def test_a_calibration_of_an_older_kv_count_is_named_in_the_projection(run):
    from homepd.twin.calibration import KV_FEATURE

    (triple,) = project(run, WhatIf(rate_scale=3.0), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1)
    twin = run.advice.twins[0]
    for feature, named in ((KV_FEATURE - 1, True), (KV_FEATURE, False)):
        again = dataclasses.replace(twin, calibration=dataclasses.replace(twin.calibration, kv_feature=feature))
        other = dataclasses.replace(run, advice=dataclasses.replace(run.advice, twins=(again,)))
        text = render(other, WhatIf(rate_scale=3.0), [triple])
        assert ("older count of the KV cells" in text) is named and "colocated-chunk-64" in text


def test_the_best_under_a_change_is_a_trusted_twins_and_a_higher_untrusted_one_is_named(run):
    (triple,) = project(run, WhatIf(rate_scale=3.0), tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1)
    doubted = dataclasses.replace(triple, candidate="replicas-2", trusted=False, projected=dataclasses.replace(
        triple.projected, capacity_rps=triple.projected.capacity_rps * 2))
    text = render(run, WhatIf(rate_scale=3.0), [triple, doubted])
    assert f"best under this change: {triple.candidate}" in text
    assert "replicas-2 project higher, but the run's checks did not trust their twins" in text
    alone = render(run, WhatIf(rate_scale=3.0), [doubted])
    assert "best under this change: replicas-2" in alone and "no twin of the run was trusted" in alone
