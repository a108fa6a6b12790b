"""The twin's capacity search (``homepd.twin.capacity``): the coarse bracket, then each seed on the fine grid, searched
only while the median or its interval needs it.  Runs on constructed seeds whose capacities are known (a run
passes at or below its seed's capacity), through a runner that counts the runs: no simulation."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from homepd.twin import capacity as cap

STEPS = 16


class Seeds:
    """``_Runner``'s two members over seeds of known capacity, for one job: ``figures`` and ``run(tasks)``."""

    def __init__(self, capacities: list[float]):
        self.capacities = capacities
        self.figures: dict = {0: {}}

    def run(self, tasks):
        runs = self.figures[0]
        for _, rate, seed in tasks:
            if (rate, seed) not in runs:
                ok = rate <= self.capacities[seed] * (1 + 1e-9)
                runs[rate, seed] = cap.RunFigures(rate, seed, 0.95 if ok else 0.5, ttft_ms=(100.0,), gap_ms=(50.0,),
                                                  misses={} if ok else {"TTFT": 1}, virtual_s=1.0, sim_s=0.0)
        return [runs[rate, seed] for _, rate, seed in tasks]


def search(capacities: list[float], start: float) -> tuple[list[float | None], int]:
    runner = Seeds(capacities)

    def whole():
        lo, hi = yield from cap._coarse_bracket(start, 0.9, 1 / 64, 64.0)
        ratio = STEPS // cap.COARSE_STEPS_PER_OCTAVE
        return (yield from cap._seed_capacities(runner.figures[0], len(capacities), lo * ratio, hi * ratio,
                                                lambda f: f.attainment >= 0.9, 1 / 64, 64.0, STEPS))

    ((found, _),) = cap._drive(runner, [whole()])
    return found, len(runner.figures[0])


def on_grid(rate: float) -> float:
    return 2.0 ** (math.floor(math.log2(rate) * STEPS + 1e-9) / STEPS)


def spread_seeds(rng: random.Random, n: int, sd_octaves: float) -> list[float]:
    centre = rng.uniform(-1.0, 1.0)
    return [2.0 ** (centre + rng.gauss(0.0, sd_octaves)) for _ in range(n)]


@pytest.mark.parametrize("n_seeds", [8, 20])
def test_the_median_and_interval_are_those_of_every_seed_searched_to_its_end(n_seeds):
    rng = random.Random(n_seeds)
    for _ in range(30):
        capacities = spread_seeds(rng, n_seeds, 0.25)
        found, _ = search(capacities, 2.0 ** rng.uniform(-1.5, 1.5))
        median, interval = cap._median_interval(found, STEPS)
        truth, truth_interval = cap._median_interval([on_grid(c) for c in capacities], STEPS)
        assert median == pytest.approx(truth) and interval == pytest.approx(truth_interval)


def test_a_seed_the_answer_does_not_read_is_left_once_it_is_shown_outside(monkeypatch):
    rng = random.Random(5)
    gated = every = 0
    for _ in range(30):
        capacities = spread_seeds(rng, 20, 0.25)
        start = 2.0 ** rng.uniform(-1.0, 1.0)
        gated += search(capacities, start)[1]
        with monkeypatch.context() as m:   # every rank read: each seed searched to its end, as before the gate
            m.setattr(cap, "_needed_ranks", lambda n: tuple(range(n)))
            every += search(capacities, start)[1]
    assert gated < 0.9 * every, (gated, every)


def test_a_seed_left_early_keeps_a_bound_on_its_side_of_the_interval():
    # 18 seeds together, one far above and one far below: neither is read by the median or its interval
    capacities = [1.0 * 2 ** (i / 64) for i in range(18)] + [6.0, 0.2]
    found, _ = search(capacities, 1.0)
    median, (lo, hi) = cap._median_interval(found, STEPS)
    assert lo <= median <= hi
    assert hi < found[18] <= on_grid(6.0)        # searched only until it showed above the interval
    assert found[19] is None or found[19] < lo   # and this one below it


def capacity_of(capacities: list[float], n_seeds: int, max_seeds: int | None, affords=None, after_s=None):
    runner = Seeds(capacities)
    question = cap.CapacityQuestion(config=None, cal=SimpleNamespace(candidate="c"), requests=None, slo=None,
                                    speeds=(None, None), start_rps=1.0, n_seeds=n_seeds, max_seeds=max_seeds,
                                    steps_per_octave=STEPS, at_half=False, affords=affords, after_s=after_s)
    ((found, _),) = cap._drive(runner, [cap._capacity_search(question, runner.figures[0])])
    return found, set(runner.figures[0])


def test_seeds_are_added_while_the_interval_is_wider_than_its_target():
    rng = random.Random(11)
    wide = [2.0 ** rng.gauss(0.0, 0.5) for _ in range(40)]     # seeds a wide box's twin spreads
    (alone, alone_runs), (more, more_runs) = capacity_of(wide, 20, None), capacity_of(wide, 20, 30)
    assert alone.n_seeds == 20 and alone.half_width > cap.TARGET_HALF_WIDTH
    assert more.n_seeds == 30 and more.half_width < alone.half_width
    assert alone_runs < more_runs     # the first 20 seeds' runs are kept, not run again


def test_seeds_are_added_only_where_the_budget_affords_their_time():
    rng = random.Random(11)
    wide = [2.0 ** rng.gauss(0.0, 0.5) for _ in range(40)]
    asked = []

    def affords(seconds: float) -> bool:
        asked.append(seconds)
        return False

    found, _ = capacity_of(wide, 20, 30, affords)
    assert found.n_seeds == 20 and asked and all(s >= 0 for s in asked)
    assert capacity_of(wide, 20, 30, lambda seconds: True)[0].n_seeds == 30


def test_the_budget_holds_what_the_caller_does_after_the_search_beside_the_added_seeds():
    rng = random.Random(11)
    wide = [2.0 ** rng.gauss(0.0, 0.5) for _ in range(40)]
    at = []

    def check_s(capacity: float) -> float:     # a check at the capacity: 30 s at these rates
        at.append(capacity)
        return 30.0

    holds_20_s = lambda seconds: seconds <= 20.0  # noqa: E731  (the added seeds' own time here is ~0)
    found, _ = capacity_of(wide, 20, 30, holds_20_s, check_s)
    assert found.n_seeds == 20
    assert at and at[0] == pytest.approx(cap._median_interval(found.seed_capacities[:20], STEPS)[0])
    assert capacity_of(wide, 20, 30, holds_20_s, lambda capacity: 10.0)[0].n_seeds == 30


def test_seeds_split_between_two_calibrations_get_no_more_seeds_that_cannot_narrow_them():
    # seed s runs on calibration s % 2 (a pool of two), and the two bursts' twins are x2.4 apart
    rng = random.Random(13)
    split = [(0.55 if s % 2 == 0 else 1.3) * 2.0 ** rng.gauss(0.0, 0.05) for s in range(40)]
    found, runs = capacity_of(split, 20, 30)
    assert found.n_seeds == 20 and found.half_width > 0.3
    assert cap._expected_half_width(found.seed_capacities, 30, STEPS) > cap.TARGET_HALF_WIDTH
    one = [2.0 ** rng.gauss(0.0, 0.25) for _ in range(40)]   # one calibration's spread: more seeds narrow it
    assert cap._expected_half_width(one[:20], 30, STEPS) < cap._expected_half_width(split[:20], 30, STEPS)


def test_seeds_at_one_cliff_give_an_interval_one_grid_step_wide_that_holds_every_crossing():
    # every seed's crossing lies between two grid rates (the box stops keeping up there): each seed passes the
    # lower and fails the upper, so its capacity is the lower; the interval says where the crossings are, not "x-x"
    rng = random.Random(14)
    low = 2.0 ** (3 / STEPS)
    crossings = [low * 2.0 ** (rng.uniform(0.05, 0.95) / STEPS) for _ in range(20)]
    found, _ = capacity_of(crossings, 20, None)
    lo, hi = found.interval_rps
    assert found.capacity_rps == pytest.approx(low) and lo == pytest.approx(low)
    assert hi == pytest.approx(2.0 ** (4 / STEPS)) and all(lo <= c < hi for c in crossings)
    assert found.half_width == pytest.approx((2.0 ** (1 / STEPS) - 1) / 2)


def test_a_narrow_interval_gets_no_more_seeds():
    rng = random.Random(12)
    narrow = [2.0 ** rng.gauss(0.0, 0.05) for _ in range(40)]
    found, _ = capacity_of(narrow, 20, 30)
    assert found.n_seeds == 20 and found.half_width <= cap.TARGET_HALF_WIDTH


def test_the_coarse_bracket_follows_the_seeds_median_not_one_seed_s_deep_miss():
    runner = Seeds([2.0, 2.0, 2.0, 0.3])     # three of the four coarse seeds serve 2 req/s, one 0.3

    def bracket():
        return (yield from cap._coarse_bracket(1.0, 0.9, 1 / 64, 64.0))

    ((found, _),) = cap._drive(runner, [bracket()])
    lo, hi = (cap._rate(k, cap.COARSE_STEPS_PER_OCTAVE) for k in found)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0 * 2 ** 0.5)
