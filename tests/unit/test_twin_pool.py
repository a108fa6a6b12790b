"""A twin's calibrations pooled across runs of one box (homepd.advise.campaign.pooled, homepd.twin.capacity).

* the seeds run on each calibration in turn: seeds on a fast burst of one box serve more than seeds on a slow one,
  and the capacity (their median) lies between;
* only earlier complete runs of the same box, the same candidate and the same workers, within a day, and with
  a quiet burst its checks confirmed (their steps within 25 % of its price), are pooled.
"""
from __future__ import annotations

import dataclasses
import datetime as dt

from homepd.advise.campaign.pooled import MAX_AGE, earlier_calibrations, recent_runs, same_workers
from homepd.core.modes import Candidate, Mode
from homepd.measure.metrics import SLO
from homepd.store.records import Run, RunAdvice, RunConfig
from homepd.twin.capacity import twin_capacity
from homepd.twin.records import TwinCheck, TwinEvidence

from test_twin import fixed_cost, one_worker
from test_whatif import CONFIG, N_REQUESTS, N_SEEDS, requests

NAME = "colocated-chunk-64"
BOX = {"hostname": "box", "cpu": {"model": "AMD EPYC", "logical_cores": 2}}
NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.timezone.utc)


def capacity(cal, pool=()):
    return twin_capacity(CONFIG, cal, requests(), SLO.from_budgets(CONFIG.class_budgets), (None, None), 1.0,
                         n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1, steps_per_octave=8, pool=pool)


def test_the_seeds_run_on_each_calibration_in_turn():
    fast, slow = one_worker(CONFIG, fixed_cost(40.0, 1.0, 4.0)), one_worker(CONFIG, fixed_cost(80.0, 2.0, 8.0))
    pooled = capacity(fast, (slow,))
    assert pooled.n_calibrations == 2
    on_fast, on_slow = pooled.seed_capacities[0::2], pooled.seed_capacities[1::2]   # seed s: (fast, slow)[s % 2]
    # steps half as long: every seed on the fast burst serves more than every seed on the slow one
    assert min(on_fast) > max(on_slow)
    assert min(on_slow) <= pooled.capacity_rps <= max(on_fast)


class Runs:
    """The store's two reads the pooling makes (``list_runs``, ``load_run``), over constructed runs."""

    def __init__(self, runs: list[tuple[Run, dict | None]]):
        self.runs = {run.id: (run, hw) for run, hw in runs}

    def list_runs(self, limit: int = 20) -> list[dict]:
        return [{"id": run.id, "status": run.status, "started_at": run.started_at,
                 "candidates": [t.candidate for t in run.advice.twins] if run.advice else []}
                for run, _ in sorted(self.runs.values(), key=lambda r: -r[0].id)][:limit]

    def load_run(self, run_id: int, timelines: bool = True) -> Run:
        run, hw = self.runs[run_id]
        return dataclasses.replace(run, hardware=hw)


def check(step_speed: float | None) -> TwinCheck:
    return TwinCheck(0.5, 1000, 12, 1.0, 150.0, 3000.0, 90.0, 1.0, 140.0, 2800.0, 85.0, mix="mixed",
                     step_speed=step_speed)


def stored(run_id: int, cal, *, status="complete", age=dt.timedelta(hours=1), name=NAME, checks=()) -> Run:
    cand = Candidate(name, Mode.COLOCATED, chunk=64)
    twin = TwinEvidence(name, dataclasses.replace(cal, candidate=name), config=CONFIG, checks=checks)
    advice = RunAdvice(candidate=cand, config=cand.config_values(), rule="colocated-best-capacity",
                       capacity=(), candidates=(cand,), twins=(twin,))
    return Run(run_id, "advise", status, RunConfig(max_tokens=16, long_tokens=120), (), advice,
               started_at=(NOW - age).isoformat())


def test_only_the_same_box_candidate_and_workers_within_a_day_are_pooled():
    cal = one_worker(CONFIG, fixed_cost(40.0, 1.0, 4.0))
    other_threads = dataclasses.replace(cal, workers=(dataclasses.replace(
        cal.workers[0], spec=dataclasses.replace(cal.workers[0].spec, n_threads=2)),))
    newer_homepd = dataclasses.replace(cal, workers=(dataclasses.replace(
        cal.workers[0], spec=dataclasses.replace(cal.workers[0].spec, wire="v2")),))
    assert not same_workers(cal, other_threads) and same_workers(cal, newer_homepd)
    # a fit whose KV term counted other cells (a calibration stored before idle cached cells were counted)
    before_idle_cells = dataclasses.replace(cal, kv_feature=cal.kv_feature - 1)
    assert not same_workers(cal, before_idle_cells) and not same_workers(before_idle_cells, cal)
    busy = dataclasses.replace(cal, other_cpu_cores=0.6)
    stalled = dataclasses.replace(cal, workers=(dataclasses.replace(
        cal.workers[0], cost=dataclasses.replace(cal.workers[0].cost, n_stalled=2)),))
    assert stalled.disturbed and busy.disturbed and not cal.disturbed
    store = Runs([
        (stored(1, cal), BOX),                                           # pooled (the oldest)
        (stored(2, cal, age=MAX_AGE + dt.timedelta(hours=1)), BOX),      # too old
        (stored(3, cal), {**BOX, "hostname": "another"}),                 # another box
        (stored(4, other_threads), BOX),                                 # other workers
        (stored(5, cal, status="incomplete"), BOX),                      # not complete
        (stored(6, cal, name="replicas-2"), BOX),                        # another candidate
        (stored(7, newer_homepd), BOX),                                  # pooled: only homepd's version differs
        (stored(8, cal), BOX),                                           # pooled
        (stored(9, cal), BOX),                                           # this run itself
        (stored(10, busy), BOX),                                         # a busy box's burst
        (stored(11, stalled), BOX),                                      # a burst the box stalled
        (stored(12, cal, checks=(check(0.70),)), BOX),                   # its check ran the steps at 0.70x
        (stored(13, cal, checks=(check(1.35), check(1.2))), BOX),        # ... at 1.2-1.35x
    ])
    runs = recent_runs(store, 9, BOX, NOW)
    found = earlier_calibrations(runs, NAME, cal, limit=3)
    assert [run_id for run_id, _ in found] == [8, 7, 1]
    confirmed = Runs([(stored(14, cal, checks=(check(1.08), check(None))), BOX)])  # within 25 %, or not measured
    assert [r for r, _ in earlier_calibrations(recent_runs(confirmed, 9, BOX, NOW), NAME, cal)] == [14]
    assert [run_id for run_id, _ in earlier_calibrations(runs, NAME, cal, limit=2)] == [8, 7]
    assert earlier_calibrations(runs, NAME, cal, limit=0) == []
    assert recent_runs(store, 9, None, NOW) == []   # a box never probed pools nothing


def test_a_what_if_pools_the_calibrations_its_run_pooled():
    from homepd.advise.whatif import WhatIf, project
    from test_whatif import tokenize

    fast, slow = one_worker(CONFIG, fixed_cost(40.0, 1.0, 4.0)), one_worker(CONFIG, fixed_cost(80.0, 2.0, 8.0))
    run = dataclasses.replace(stored(11, fast), id=11)
    what = WhatIf(itl_budget_ms=60.0)   # the slow burst's decode step (88 ms) cannot keep it, the fast one's can
    (alone,) = project(run, what, tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1, max_seeds=N_SEEDS)
    (pooled,) = project(run, what, tokenize, n_seeds=N_SEEDS, n_requests=N_REQUESTS, processes=1, max_seeds=N_SEEDS,
                        pools={NAME: (slow,)})
    assert pooled.projected.n_calibrations == 2 and alone.projected.n_calibrations == 1
    on_slow = [c or 0.0 for c in pooled.projected.seed_capacities[1::2]]   # seeds 1 and 3 ran on the slow burst
    assert max(on_slow) < min(c or 0.0 for c in alone.projected.seed_capacities)
