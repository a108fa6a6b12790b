"""A candidate's capacity from its twin: many seeds, many requests, a fine rate grid; and the twin's prediction of
one given trace (what a measured probe is checked against).

**Capacity.**  The same question as the measured search (``homepd.advise.campaign.capacity``): the highest Poisson
rate at which at least the target share of requests meet every SLO of their class and the box keeps up, on the same
seeded traces.  Each of ``n_seeds`` seeds (a trace of ``n_requests`` and the twin's own draws of the box's noise) is
searched on its own on a grid of ``FINE_STEPS_PER_OCTAVE`` steps per octave, from a bracket that a few seeds found
on the coarse grid, by the measured search's rule (the highest passing rate below the lowest failing one).  The
capacity is the median of the seeds' capacities; its interval is the order-statistic interval of that median (at
least 90 % confidence, distribution-free); the seeds' spread is kept too.  Runs go to a pool of processes (one per
core): the engine is not running while the twin is.

**Calibrations pooled.**  ``pool``: earlier calibrations of the same candidate on the same box (the campaign
finds them: ``homepd.advise.campaign.pooled``); seed ``s`` (and a prediction's draw ``s``) runs on
``(cal, *pool)[s % n]``.  A 17-second burst sees the box for 17 seconds: on a 2-vCPU VM two bursts a few minutes
apart fitted steps 25 % apart and tails twice as long, and the capacity moved ×2 with them; across several,
the median is the box's, and the seeds' spread carries the calibrations' own.

**Prediction.**  A given trace (a probe's own requests and arrivals) simulated with ``n_draws`` draws of the box's
noise: the mean attainment, TTFT p50 and p90 and the p90 of each interactive request's largest gap, what the
evidence shows beside the measurement.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Generator

from homepd.measure.curve import KEPT_UP, drain_allowance_s
from homepd.twin.calibration import Calibration
from homepd.twin.records import CONFIDENCE, TwinCapacity, TwinPoint, TwinPrediction
from homepd.twin.sim import SimRequest, simulate
from homepd.config import EngineConfig
from homepd.stats import percentile
from homepd.core.terms import RequestClass
from homepd.measure.curve import DEFAULT_TARGET_SHARE
from homepd.measure.metrics import SLO

N_SEEDS = 20
MIN_SEEDS = 5       # the fewest seeds whose lowest and highest capacity hold the median at 90 % (1 - 2/2^5)
N_REQUESTS = 200
MIN_REQUESTS = 50   # the fewest requests a simulated run gives an attainment from (a miss moves it 2 points)
COARSE_SEEDS = 4
COARSE_STEPS_PER_OCTAVE = 2
FINE_STEPS_PER_OCTAVE = 16       # a grid step of 4.4 %
MAX_BRACKET_MOVES = 12
SEED_FLOOR_OCTAVES = 2   # how far under the coarse bracket a seed's own search may go
TARGET_HALF_WIDTH = 0.12   # seeds are added while the interval is wider than this share either way ...
MORE_SEEDS = 10            # ... this many at a time (CapacityQuestion.max_seeds) ...
MIN_JUDGED_SEEDS = 10      # ... where this many seeds or more say that max_seeds would bring it within the target
PREDICTION_DRAWS = 16   # a check's trace is short: its draws cost ~0.1 s each


@dataclass(frozen=True)
class RunFigures:
    """One simulated run, as the evidence counts it."""
    rate_rps: float
    seed: int
    attainment: float
    ttft_ms: tuple[float, ...]           # every request's
    gap_ms: tuple[float, ...]            # every interactive request's largest gap
    misses: dict[str, int]
    virtual_s: float
    sim_s: float
    met: tuple[bool, ...] = ()           # each request's outcome, in the trace's order (what a check is tested on)


Requests = Callable[[float, int], list[SimRequest]]   # (rate, seed) -> the seed's trace at that rate


# ---- one run ---------------------------------------------------------------------------------------------------

def run_figures(config: EngineConfig, cal: Calibration, requests: list[SimRequest], slo: SLO,
                speeds: tuple[float | None, float | None], rate_rps: float, seed: int,
                target_share: float | None = None) -> RunFigures:
    """Simulate ``requests`` and count them as a measured probe is counted (``probe_of``'s rule: every SLO of its
    class, and done within the drain allowance of the last arrival).  ``target_share``: stop the run once more
    requests missed than it allows (the outcome is decided; its attainment is then an upper bound, under it)."""
    stop_when = None
    if target_share is not None:
        allowed, missed = len(requests) - math.ceil(target_share * len(requests) - 1e-9), [0]

        def stop_when(lc) -> bool:
            missed[0] += slo.miss(lc) is not None
            return missed[0] > allowed

    t0 = time.perf_counter()
    run = simulate(config, cal, requests, seed, stop_when=stop_when)
    sim_s = time.perf_counter() - t0
    allowance = None if run.stopped else drain_allowance_s(run.requests, slo, speeds)
    deadline = max(lc.arrived_s for lc in run.requests) + allowance if allowance is not None else None
    outcomes, misses = [], {}
    for lc in run.requests:
        if run.stopped and lc.ended_s is None:
            outcomes.append(False)
            continue  # the run stopped once decided: what had not ended is not met (what a stopped probe counts)
        missed = slo.miss(lc)
        what = slo.target_text(missed) if missed is not None else None
        if what is None and deadline is not None and lc.ended_s is not None and lc.ended_s > deadline:
            what = KEPT_UP
        outcomes.append(what is None)
        if what is not None:
            misses[what] = misses.get(what, 0) + 1
    met = sum(outcomes)
    ttft = tuple(lc.ttft_s * 1e3 for lc in run.requests if lc.ttft_s is not None)
    gaps = tuple(max(lc.itl_s) * 1e3 for lc in run.requests
                 if lc.request_class is RequestClass.INTERACTIVE and len(lc.token_times_s) > 1)
    return RunFigures(rate_rps, seed, met / len(requests), ttft, gaps, misses, run.end_s, sim_s, tuple(outcomes))


@dataclass(frozen=True)
class _Job:
    """What one question's runs share (a candidate's configuration, calibrations, traces, SLO)."""
    config: EngineConfig
    cals: tuple[Calibration, ...]
    requests: Requests
    slo: SLO
    speeds: tuple[float | None, float | None]
    stop_share: float | None = None


# the pool's workers read the jobs from here (forked: nothing is pickled but the task)
_JOBS: dict[int, _Job] = {}


def _run_task(task: tuple[int, float, int]) -> RunFigures:
    key, rate, seed = task
    j = _JOBS[key]
    return run_figures(j.config, calibration_for(j.cals, seed), j.requests(rate, seed), j.slo, j.speeds, rate, seed,
                       j.stop_share)


def calibration_for(cals: tuple[Calibration, ...], seed: int) -> Calibration:
    """The calibration seed ``seed`` runs on: this run's and the pooled ones in turn (the module docstring)."""
    return cals[seed % len(cals)]


class _Runner:
    """Runs (job, rate, seed) tasks in a pool of forked processes (one per usable core), or in this process."""

    def __init__(self, jobs: list[_Job], processes: int | None):
        _JOBS.clear()
        _JOBS.update(enumerate(jobs))
        n = processes or len(os.sched_getaffinity(0))
        self.pool = multiprocessing.get_context("fork").Pool(n) if n > 1 else None
        self.figures: dict[int, dict[tuple[float, int], RunFigures]] = {key: {} for key in range(len(jobs))}

    def run(self, tasks: list[tuple[int, float, int]]) -> list[RunFigures]:
        todo = [t for t in dict.fromkeys(tasks) if t[1:] not in self.figures[t[0]]]
        # why one task at a time: runs are uneven (a failing one stops once decided), and map's default chunks of
        # three left one process idle while the other finished its chunk
        done = (self.pool.map(_run_task, todo, chunksize=1) if self.pool is not None and len(todo) > 1
                else map(_run_task, todo))
        for (key, *task), figures in zip(todo, done):
            self.figures[key][tuple(task)] = figures
        return [self.figures[key][rate, seed] for key, rate, seed in tasks]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
        _JOBS.clear()


# A search is a generator: it yields the (rate, seed) runs it needs next, is sent their figures, and returns its
# answer; ``_drive`` runs every search's next runs together, so that several questions share one pool's rounds.
Search = Generator[list[tuple[float, int]], list[RunFigures], object]


def _drive(runner: _Runner, searches: list[Search]) -> list[tuple[object, float]]:
    """Each search's answer and the seconds it took (searches ``i`` runs on ``runner``'s job ``i``)."""
    t0 = time.monotonic()
    out: list[tuple[object, float]] = [(None, 0.0)] * len(searches)
    pending: dict[int, list[tuple[float, int]]] = {}

    def advance(i: int, figures: list[RunFigures] | None) -> None:
        try:
            pending[i] = searches[i].send(figures)
        except StopIteration as stop:
            pending.pop(i, None)
            out[i] = (stop.value, time.monotonic() - t0)

    for i in range(len(searches)):
        advance(i, None)
    while pending:
        rounds = list(pending.items())
        done = iter(runner.run([(i, rate, seed) for i, tasks in rounds for rate, seed in tasks]))
        for i, tasks in rounds:
            advance(i, [next(done) for _ in tasks])
    return out


# ---- the search ----------------------------------------------------------------------------------------------

def _rate(k: int, steps: int) -> float:
    return 2.0 ** (k / steps)


def _index(rate: float, steps: int) -> int:
    return round(math.log2(rate) * steps)


@dataclass(frozen=True)
class CapacityQuestion:
    """One candidate's capacity question for ``twin_capacities`` (the arguments of ``twin_capacity``)."""
    config: EngineConfig
    cal: Calibration
    requests: Requests
    slo: SLO
    speeds: tuple[float | None, float | None]
    start_rps: float
    mix: str = "mixed"
    n_seeds: int = N_SEEDS
    n_requests: int = N_REQUESTS
    target_share: float = DEFAULT_TARGET_SHARE
    min_rate_rps: float = 1 / 64
    max_rate_rps: float = 64.0
    steps_per_octave: int = FINE_STEPS_PER_OCTAVE
    pool: tuple[Calibration, ...] = ()
    at_half: bool = True
    # seeds are added (``MORE_SEEDS`` at a time, up to ``max_seeds``) while the interval's half-width, as a share
    # of the capacity, is over ``half_width``; ``max_seeds`` None: ``n_seeds`` only
    max_seeds: int | None = None
    half_width: float = TARGET_HALF_WIDTH
    more_seeds: int = MORE_SEEDS
    # affords(seconds): whether the caller's time budget holds ``seconds`` more (None: no budget); seeds are added
    # only where it holds their estimated time (this search's time so far, per seed) and ``after_s(capacity)``, what
    # the caller still has to do at the capacity once the search ends (a campaign: its check probe)
    affords: Callable[[float], bool] | None = None
    after_s: Callable[[float], float] | None = None

    def __post_init__(self):
        if self.max_seeds is None or self.max_seeds < self.n_seeds:
            object.__setattr__(self, "max_seeds", self.n_seeds)

    def job(self) -> _Job:
        return _Job(self.config, (self.cal, *self.pool), self.requests, self.slo, self.speeds, self.target_share)


def twin_capacity(config: EngineConfig, cal: Calibration, requests: Requests, slo: SLO,
                  speeds: tuple[float | None, float | None], start_rps: float, *, processes: int | None = None,
                  **options) -> TwinCapacity:
    """The capacity of ``config`` (calibrated as ``cal``, with the earlier calibrations ``pool``) on
    ``requests(rate, seed)``; see the module docstring and ``CapacityQuestion`` for the options.  ``at_half``: also
    the attainment at half the capacity (``COARSE_SEEDS`` runs more: what the campaign's rule reads to tell noise
    from load; what-if does not)."""
    (answer,), _ = twin_capacities([CapacityQuestion(config, cal, requests, slo, speeds, start_rps, **options)],
                                   processes)
    return answer


def twin_capacities(questions: list[CapacityQuestion], processes: int | None = None,
                    reference: list[tuple[CapacityQuestion, float, range]] = ()
                    ) -> tuple[list[TwinCapacity], list[list[RunFigures]]]:
    """Every question's capacity, searched together: each round runs every search's next runs in one pool (a
    search of a few seeds leaves cores idle in its last rounds, which another's fill); and, for each ``reference``
    (question, rate, seeds), those seeds' runs at that rate to their end (every request's outcome counted)."""
    jobs = [q.job() for q in questions] + [replace(q.job(), stop_share=None) for q, _, _ in reference]
    runner = _Runner(jobs, processes)
    try:
        searches = [_capacity_search(q, runner.figures[i]) for i, q in enumerate(questions)]
        searches += [_runs_at(rate, seeds) for _, rate, seeds in reference]
        answers = _drive(runner, searches)
    finally:
        runner.close()
    return ([replace(answer, wall_s=wall_s) for answer, wall_s in answers[:len(questions)]],
            [answer for answer, _ in answers[len(questions):]])


def _runs_at(rate_rps: float, seeds: range):
    return (yield [(rate_rps, s) for s in seeds])


def _capacity_search(q: CapacityQuestion, figures: dict[tuple[float, int], RunFigures]):
    """The search of one question (a ``Search``): ``figures`` is its job's runs so far (the runner's)."""
    target_share, steps_per_octave = q.target_share, q.steps_per_octave
    passes = lambda fig: fig.attainment >= target_share - 1e-12  # noqa: E731
    lo, hi = yield from _coarse_bracket(q.start_rps, target_share, q.min_rate_rps, q.max_rate_rps)
    ratio = steps_per_octave // COARSE_STEPS_PER_OCTAVE
    # why a floor under the bracket: a seed that fails wherever it is tried walked down to 1/64 req/s, where a
    # run of 200 requests simulates hours of sparse traffic step by step (a busy calibration's colocated twin
    # took 122 s, 1.1 million simulated seconds, for a capacity its median did not use); a seed failing
    # SEED_FLOOR_OCTAVES under the bracket's passing end counts as serving nothing
    floor_rps = max(q.min_rate_rps, _rate(lo, COARSE_STEPS_PER_OCTAVE) / 2 ** SEED_FLOOR_OCTAVES)
    n_seeds, t0 = q.n_seeds, time.monotonic()
    while True:
        seed_caps = yield from _seed_capacities(figures, n_seeds, lo * ratio, hi * ratio, passes, floor_rps,
                                                q.max_rate_rps, steps_per_octave)
        capacity, interval = _median_interval(seed_caps, steps_per_octave)
        # why more seeds where the interval is wide: pooled calibrations or a noisy burst spread the seeds, and 20
        # of them left one disaggregated twin's interval at +-19 %; the order statistics of more seeds narrow it
        # (ranks 5-14 of 20, 10-19 of 30: about a third narrower), and the seeds already searched are kept
        if n_seeds >= q.max_seeds or capacity is None or (interval[1] - interval[0]) / 2 / capacity <= q.half_width:
            break
        more = min(q.max_seeds, n_seeds + q.more_seeds)
        # why not where more seeds cannot bring it in: two pooled calibrations that disagree split the seeds in two
        # (a quick run's colocated twin: 0.50-0.71 req/s on one burst's calibration, 1.09-1.54 on the other's), and
        # its 10 seeds more took 20 s of the 2 minutes and left the interval at +-39 %
        if n_seeds >= MIN_JUDGED_SEEDS and \
                _expected_half_width(seed_caps, q.max_seeds, steps_per_octave) > q.half_width:
            break
        # why asked: a quick campaign's disaggregated twin added its 10 seeds after a 26-s search and ended the
        # campaign at 125 s of its 2 minutes
        # why after_s: the quick campaign's last twin added its seeds within the budget and then ran its
        # 12-request check at 0.37 req/s (31 s) past it, ending at 137 s of its 2 minutes
        extra_s = (time.monotonic() - t0) * (more - n_seeds) / n_seeds
        if q.affords is not None and not q.affords(extra_s + (q.after_s(capacity) if q.after_s else 0.0)):
            break
        n_seeds = more
    half = None
    if capacity is not None and q.at_half:
        # why: how flat the curve is below the capacity says whether load or the box's noise makes the misses
        half = statistics.mean(f.attainment for f in (yield [(capacity / 2, s) for s in range(COARSE_SEEDS)]))
    runs = list(figures.values())
    return TwinCapacity(
        candidate=q.cal.candidate, mix=q.mix, target_share=target_share, capacity_rps=capacity, interval_rps=interval,
        seed_capacities=tuple(seed_caps), points=_points(runs), n_seeds=n_seeds, n_requests=q.n_requests,
        resolution_rps=(capacity or 1.0) * (2 ** (1 / steps_per_octave) - 1),
        sim_s=sum(f.sim_s for f in runs), virtual_s=sum(f.virtual_s for f in runs),
        wall_s=0.0, decided_by=_decided_by(runs, capacity, target_share),
        attainment_at_half=half, n_calibrations=1 + len(q.pool))


def _coarse_bracket(start_rps: float, target_share: float, min_rate: float, max_rate: float):
    """Adjacent coarse grid indices (passing, failing) of the median attainment of ``COARSE_SEEDS`` seeds, from
    ``start_rps`` up while it passes and down while it fails (the range's end where it never turns); a
    ``Search``."""
    steps = COARSE_STEPS_PER_OCTAVE
    k_min, k_max = math.ceil(math.log2(min_rate) * steps), math.floor(math.log2(max_rate) * steps)
    k = min(max(_index(start_rps, steps), k_min), k_max)
    passed: dict[int, bool] = {}
    for _ in range(MAX_BRACKET_MOVES):
        figs = yield [(_rate(k, steps), s) for s in range(COARSE_SEEDS)]
        # why the median: the capacity is the seeds' median, and one seed's deep miss (66 % where three passed)
        # pulled the mean under the target, put the bracket a step low, and cost every other seed 3 runs more
        # (6-13 % more runs in all, on constructed seeds)
        passed[k] = statistics.median(f.attainment for f in figs) >= target_share - 1e-12
        if passed[k]:
            if passed.get(k + 1) is False or k >= k_max:
                break
            k += 1
        else:
            if passed.get(k - 1) is True or k <= k_min:
                break
            k -= 1
    fails = [j for j, ok in passed.items() if not ok]
    low_fail = min(fails) if fails else max(passed) + 1
    below = [j for j, ok in passed.items() if ok and j < low_fail]
    return (max(below) if below else low_fail - 1), low_fail


def _seed_capacities(figures: dict[tuple[float, int], RunFigures], n_seeds: int, lo: int, hi: int, passes,
                     min_rate: float, max_rate: float, steps: int = FINE_STEPS_PER_OCTAVE):
    """Each seed's capacity on the fine grid, by bisection from [``lo``, ``hi``] (grid indices), every seed's
    next rate run together (one pool round per step).  The bracket's ends are taken as passing and failing
    until a seed's search ends on one: only then is that end run (a third fewer runs than running both ends of
    every seed first; a seed for which the end turns out otherwise searches on past it).

    A seed is searched only while the answer needs it: while what its runs so far allow for its capacity meets
    what they allow for an order statistic the median or its interval reads (``_needed_ranks``) that is not yet
    known.  A seed shown to lie wholly above or below those is left there, its entry the highest rate it passed
    (a bound, on the right side of every statistic read: the median and the interval come out as if every seed
    had been searched to the end; 18-32 % fewer runs for 20 seeds, on constructed seeds)."""
    k_min, k_max = math.ceil(math.log2(min_rate) * steps), math.floor(math.log2(max_rate) * steps)
    lo, hi = max(lo, k_min), min(hi, k_max)
    state = {s: {} for s in range(n_seeds)}       # seed -> {index: passed}
    for (rate, seed), fig in figures.items():   # the coarse bracket's runs are this grid's too
        if seed < n_seeds:
            state[seed][_index(rate, steps)] = passes(fig)
    ranks = _needed_ranks(n_seeds)
    while True:
        known = {s: _known(seen) for s, seen in state.items()}
        lows, highs = sorted(a for a, _ in known.values()), sorted(b for _, b in known.values())
        open_ranks = [(lows[r], highs[r]) for r in ranks if lows[r] != highs[r]]
        todo = {s: k for s, seen in state.items()
                if known[s][0] != known[s][1] and any(known[s][0] <= b and known[s][1] >= a for a, b in open_ranks)
                and (k := _next_assumed(seen, lo, hi, k_min, k_max, steps)) is not None}
        if not todo:
            break
        for fig in (yield [(_rate(k, steps), s) for s, k in todo.items()]):
            state[fig.seed][_index(fig.rate_rps, steps)] = passes(fig)
    return [_capacity_of(seen, steps) for seen in state.values()]


def _known(seen: dict[int, bool]) -> tuple[float, float]:
    """The grid indices a seed's capacity can still be, by the search's rule, from its runs so far: from its
    highest pass below its lowest failure to one under that failure (infinite where none)."""
    bad = [k for k, ok in seen.items() if not ok]
    low_fail = min(bad) if bad else math.inf
    good = [k for k, ok in seen.items() if ok and k < low_fail]
    return (max(good) if good else -math.inf), low_fail - 1


def _next_assumed(seen: dict[int, bool], lo: int, hi: int, k_min: int, k_max: int, steps: int) -> int | None:
    """``_next_index`` with the bracket's ends assumed (``lo`` passing, ``hi`` failing) where not run; an
    assumed end the search ended on is the next to run."""
    merged = {**({lo: True} if lo < hi else {}), hi: False, **seen}
    nxt = _next_index(merged, k_min, k_max, steps)
    if nxt is not None:
        return nxt
    bad = [k for k, ok in merged.items() if not ok]
    low_fail = min(bad) if bad else None
    good = [k for k, ok in merged.items() if ok and (low_fail is None or k < low_fail)]
    for edge in (max(good) if good else None, low_fail):
        if edge is not None and edge not in seen:
            return edge
    return None


def _next_index(seen: dict[int, bool], k_min: int, k_max: int, steps: int) -> int | None:
    """The measured search's next move on one seed's results: up while nothing failed, down while nothing passed
    below the lowest failure, then bisection to adjacent grid points."""
    bad = [k for k, ok in seen.items() if not ok]
    low_fail = min(bad) if bad else None
    good = [k for k, ok in seen.items() if ok and (low_fail is None or k < low_fail)]
    if low_fail is None:
        top = max(seen)
        return None if top >= k_max else min(k_max, top + steps // 4)
    if not good:
        return None if low_fail <= k_min else max(k_min, low_fail - steps // 4)
    high_pass = max(good)
    if low_fail - high_pass <= 1:
        return None
    return (high_pass + low_fail) // 2


def _capacity_of(seen: dict[int, bool], steps: int) -> float | None:
    bad = [k for k, ok in seen.items() if not ok]
    low_fail = min(bad) if bad else None
    good = [k for k, ok in seen.items() if ok and (low_fail is None or k < low_fail)]
    return _rate(max(good), steps) if good else None


def _median_interval(caps: list[float | None], steps: int) -> tuple[float | None, tuple[float, float] | None]:
    """The median of the seeds' capacities (a seed where nothing passed counts as 0) and the distribution-free
    interval of the median at ``CONFIDENCE`` (order statistics of the binomial), on a grid of ``steps`` an octave.
    A seed's capacity is the highest grid rate it passed, and its crossing lies below the next: so the interval
    runs from its lower order statistic to one grid step above its upper one.  # why: seeds that all passed 2.00
    and failed 2.18 req/s (a cliff: the box stops keeping up) gave "[2.00-2.00]", an interval of no width for a
    crossing known only to the grid's 9 %; a measured search's spread runs to its failing rate for the same reason"""
    values = sorted(c if c is not None else 0.0 for c in caps)
    n = len(values)
    if not n:
        return None, None
    median = statistics.median(values)
    lo, hi = _interval_ranks(n)
    return (median if median > 0 else None), (values[lo], values[hi] * _rate(1, steps))


def _expected_half_width(caps: list[float | None], n: int, steps: int) -> float:
    """The half-width, as a share of the median, that the interval of ``n`` seeds drawn as ``caps`` were would have
    (``_median_interval``'s, on a grid of ``steps`` an octave): its order statistics' ranks read at the same
    quantiles of ``caps`` (a seed where nothing passed counts as 0; infinite where the median is 0)."""
    values = sorted(c if c is not None else 0.0 for c in caps)
    median = statistics.median(values)
    if median <= 0:
        return math.inf
    lo, hi = _interval_ranks(n)
    at = lambda rank: values[round(rank * (len(values) - 1) / max(1, n - 1))]  # noqa: E731
    return (at(hi) * _rate(1, steps) - at(lo)) / 2 / median


def _interval_ranks(n: int) -> tuple[int, int]:
    """The 0-based ranks of the sorted seeds' capacities that bound the median's interval at ``CONFIDENCE``."""
    tail, j = (1 - CONFIDENCE) / 2, 0
    while j + 1 < n / 2 and _binom_cdf(j, n) <= tail:   # ranks j+1 .. n-j hold the median at CONFIDENCE
        j += 1
    return max(0, j - 1), min(n - 1, n - j)


def _needed_ranks(n: int) -> tuple[int, ...]:
    """The 0-based ranks of the sorted seeds' capacities that ``_median_interval`` reads."""
    middle = (n // 2 - 1, n // 2) if n % 2 == 0 else (n // 2,)
    return tuple(sorted({*_interval_ranks(n), *middle}))


def _binom_cdf(k: int, n: int) -> float:
    """P(X < k+1) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def _points(figures: list[RunFigures]) -> tuple[TwinPoint, ...]:
    by_rate: dict[float, list[RunFigures]] = {}
    for f in figures:
        by_rate.setdefault(round(f.rate_rps, 9), []).append(f)
    out = []
    for rate in sorted(by_rate):
        figs = by_rate[rate]
        ttft = [t for f in figs for t in f.ttft_ms]
        gaps = [g for f in figs for g in f.gap_ms]
        out.append(TwinPoint(rate, statistics.mean(f.attainment for f in figs), tuple(f.attainment for f in figs),
                             percentile(ttft, 50), percentile(ttft, 90), percentile(gaps, 90)))
    return tuple(out)


def _decided_by(figures: list[RunFigures], capacity: float | None, target_share: float) -> str:
    failing = [f for f in figures if f.attainment < target_share and (capacity is None or f.rate_rps > capacity)]
    misses: dict[str, int] = {}
    for f in failing:
        for what, n in f.misses.items():
            misses[what] = misses.get(what, 0) + n
    if not failing:
        return "nothing failed in the twin"
    return max(misses.items(), key=lambda kv: kv[1])[0] if misses else "attainment under the target share"


# ---- one trace -------------------------------------------------------------------------------------------------

def predict(config: EngineConfig, cal: Calibration, requests: list[SimRequest], slo: SLO,
            speeds: tuple[float | None, float | None], rate_rps: float, n_draws: int = PREDICTION_DRAWS,
            pool: tuple[Calibration, ...] = (), processes: int | None = None) -> TwinPrediction:
    """The twin's prediction of ``requests`` (a probe's own trace): means over ``n_draws`` draws of the noise, each
    request's share of the draws in which it met its SLO (``TwinPrediction.chances``) and each draw's count of
    requests met (``counts``); the draws run in a pool of processes as a capacity's runs do."""
    (prediction,) = predict_at(config, cal, [(rate_rps, requests)], slo, speeds, n_draws, pool, processes)
    return prediction


def predict_at(config: EngineConfig, cal: Calibration, traces: list[tuple[float, list[SimRequest]]], slo: SLO,
               speeds: tuple[float | None, float | None], n_draws: int = PREDICTION_DRAWS,
               pool: tuple[Calibration, ...] = (), processes: int | None = None) -> list[TwinPrediction]:
    """``predict`` for several (rate, requests) traces at once, their draws in one pool's rounds."""
    jobs = [_Job(config, (cal, *pool), lambda rate, seed, reqs=reqs: reqs, slo, speeds) for _, reqs in traces]
    runner = _Runner(jobs, processes)
    try:
        answers = _drive(runner, [_runs_at(rate, range(n_draws)) for rate, _ in traces])
    finally:
        runner.close()
    return [_prediction(figs, n_draws) for figs, _ in answers]


def _prediction(figs: list[RunFigures], n_draws: int) -> TwinPrediction:
    n = min(len(f.met) for f in figs)

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    return TwinPrediction(statistics.mean(f.attainment for f in figs),
                          mean(percentile(list(f.ttft_ms), 50) for f in figs),
                          mean(percentile(list(f.ttft_ms), 90) for f in figs),
                          mean(percentile(list(f.gap_ms), 90) for f in figs), n_draws,
                          tuple(sum(f.met[i] for f in figs) / len(figs) for i in range(n)),
                          tuple(sum(f.met[:n]) for f in figs))
