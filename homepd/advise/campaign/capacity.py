"""The capacity search: the highest arrival rate at which at least a target share of requests meet every SLO
of their class (DistServe's SLO capacity, and ``benchmarks/slo_capacity.py``'s), found by search.

Pure: no engine, no clock.  The campaign asks ``CapacitySearch.next_rate()``, replays a probe trace of
``probe_requests(rate)`` requests at that rate, tells ``record(probe)``, and ends with ``curve()``.

**The grid.**  Every probed rate lies on one geometric grid shared by every search: ``2 ** (k / steps_per_octave)``
req/s, k an integer.  A finer grid (the full campaign's) contains the coarser one (the quick one's, when its
steps per octave divide the full one's), so on the same attainment curve the full answer lies inside the quick
answer's interval (``answer_interval``; tested on constructed curves).  The resolution is one grid step:
``capacity * (2 ** (1 / steps_per_octave) - 1)`` req/s.

**The search.**  Start at the grid rate nearest an estimate from the box's measured prefill and decode speeds
(``start_rate_rps``); while no probe failed, go up ``grow_steps`` grid steps; while none passed, go down
``shrink_steps`` (default as many: a probe below is longer, so a campaign short of time steps down by less); then bisect the grid steps between the highest passing rate below the lowest failing one and that
failing rate, until they are adjacent (the resolution) or the probe budget (``max_probes`` probes, at most
``time_budget_s`` of probing: the probes' durations) is spent; the rate stays within [``min_rate_rps``,
``max_rate_rps``], and above the rate at which the smallest probe alone would take the whole time budget (when every probe fails there,
the capacity is reported as below it).

**Noise.**  Attainment is not monotone in the rate on a real box (one unlucky burst).  The rule: *the capacity
is the highest passing rate below the lowest failing one*.  A pass above a failure stays in the curve but
never raises the capacity: the answer is conservative, an unlucky probe lowers it by at most the bracket it
lands in, and the full campaign's repeats (new seeds) show the spread.

**Probe length** (``probe_requests``).  At least ``ceil(1 / attainment_resolution)`` requests, so that one
failed request moves the attainment by at most that resolution (10 requests: 10 points, and a 90 % target
tolerates exactly one miss), and more while their arrivals fit ``probe_s`` seconds, at most ``max_requests``.
``probe_s`` is what makes a probe a *rate* and not a burst: one grid step above the capacity, the backlog grows
by ``(ratio - 1)`` seconds of work per second of arrivals, so it reaches the interactive TTFT budget only after
``TTFT / (ratio - 1)`` seconds (``probe_span_s``: 10 s on the quick grid, 22 s on the full one, for 4 s).  A
shorter probe lets a box absorb a burst it could not sustain (12 requests at 8 req/s "passed" on this box).

**Prior probes.**  A search may start from the probes of a coarser search of the same candidate and mix
(``CapacitySearch(prior=...)``): on a grid that contains the coarse one, they are points of its own, and the
search bisects on from their bracket (the full campaign refines its contenders that way).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

# the search's records live below the store, which decodes them back (``homepd.measure.curve``)
from homepd.measure.curve import DEFAULT_TARGET_SHARE, CapacityCurve, Probe


@dataclass(frozen=True)
class SearchSettings:
    """How fine and how long one search is (the quick campaign: coarse and short)."""
    target_share: float = DEFAULT_TARGET_SHARE
    steps_per_octave: int = 4          # grid ratio 2 ** (1/4): 19 % resolution
    grow_steps: int = 4                # grid steps per bracketing move (4 = a factor of 2 on this grid)
    shrink_steps: int | None = None    # grid steps down while nothing passed (None: grow_steps)
    max_probes: int = 6
    time_budget_s: float = 120.0       # the probes' durations summed over one search
    attainment_resolution: float = 0.1
    probe_s: float = 12.0
    max_requests: int = 40
    min_rate_rps: float = 1 / 64
    max_rate_rps: float = 64.0

    def __post_init__(self):
        assert 0 < self.target_share <= 1 and self.steps_per_octave >= 1 and self.grow_steps >= 1
        assert self.max_probes >= 1 and 0 < self.attainment_resolution <= 1


def grid_rate(k: int, steps_per_octave: int) -> float:
    return 2.0 ** (k / steps_per_octave)


def grid_index(rate_rps: float, steps_per_octave: int) -> int:
    """The grid point nearest ``rate_rps`` (in log space)."""
    return round(math.log2(rate_rps) * steps_per_octave)


def probe_span_s(ttft_budget_s: float, steps_per_octave: int) -> float:
    """The arrivals' span that lets a probe one grid step above the capacity build a backlog of the TTFT budget
    (see the module docstring), rounded up to a second."""
    return float(math.ceil(ttft_budget_s / (2 ** (1 / steps_per_octave) - 1) - 1e-9))


def start_rate_rps(prefill_tok_s: float | None, decode_step_ms: float | None, mean_prompt_tokens: float,
                   mean_output_tokens: float, utilisation: float = 0.5, default_rps: float = 1.0) -> float:
    """A first rate to probe: ``utilisation`` of the rate at which one request at a time (its prompt at the
    measured prefill speed, then its output one decode step per token) would keep the box busy.  Batching
    lets the real capacity be higher, stalls lower: it is where the bracket starts, not an answer.
    ``default_rps`` when a speed was not measured."""
    if not prefill_tok_s or not decode_step_ms or prefill_tok_s <= 0 or decode_step_ms <= 0:
        return default_rps
    service_s = mean_prompt_tokens / prefill_tok_s + mean_output_tokens * decode_step_ms / 1e3
    return utilisation / max(service_s, 1e-6)


def probe_requests(rate_rps: float, settings: SearchSettings) -> int:
    """Requests in a probe at ``rate_rps`` (see the module docstring: one miss moves the attainment by at most
    ``attainment_resolution``; more while the arrivals fit ``probe_s``)."""
    floor_n = math.ceil(1 / settings.attainment_resolution - 1e-9)
    return max(floor_n, min(settings.max_requests, math.ceil(rate_rps * settings.probe_s)))


def _passes(p: Probe, target_share: float) -> bool:
    return p.attainment >= target_share - 1e-12


class CapacitySearch:
    """Ask/tell search of one candidate's capacity on one mix (one repeat)."""

    def __init__(self, start_rps: float, settings: SearchSettings = SearchSettings(), prior: tuple[Probe, ...] = ()):
        self.settings = settings
        s = settings
        # why: below the rate at which the fewest meaningful requests fill the whole time budget, no probe fits
        floor_rps = max(s.min_rate_rps, probe_requests(0.0, s) / s.time_budget_s)
        self._k_min = math.ceil(math.log2(floor_rps) * s.steps_per_octave - 1e-9)
        self._k_max = math.floor(math.log2(s.max_rate_rps) * s.steps_per_octave + 1e-9)
        start = min(max(start_rps, s.min_rate_rps), s.max_rate_rps)
        self._k_start = min(max(grid_index(start, s.steps_per_octave), self._k_min), self._k_max)
        self.probes: list[Probe] = []
        self._ks: list[int] = []
        self.n_prior = len(prior)
        for p in prior:  # a coarser search's probes: points of this grid too (its steps divide these)
            self.record(p)

    # the state, in grid indices ----------------------------------------------------------------------
    def _bracket(self) -> tuple[int | None, int | None]:
        """(highest passing index below the lowest failing one, lowest failing index)."""
        target = self.settings.target_share
        fails = [k for k, p in zip(self._ks, self.probes) if not _passes(p, target)]
        low_fail = min(fails) if fails else None
        passes = [k for k, p in zip(self._ks, self.probes) if _passes(p, target)
                  and (low_fail is None or k < low_fail)]
        return (max(passes) if passes else None), low_fail

    def _spent_s(self) -> float:
        return sum(p.duration_s for p in self.probes[self.n_prior:])

    def next_rate(self) -> float | None:
        """The next rate to probe, or None: converged, out of budget, or at the end of the rate range."""
        s = self.settings
        own = len(self.probes) - self.n_prior
        if own >= s.max_probes or (own and self._spent_s() >= s.time_budget_s):
            return None
        k = self._next_index()
        if k is None or k in self._ks:
            return None
        rate = grid_rate(k, s.steps_per_octave)
        # why: a probe whose arrivals would overrun the time budget is not started (the first always is)
        if own and self._spent_s() + probe_requests(rate, s) / rate > s.time_budget_s:
            return None
        return rate

    def _next_index(self) -> int | None:
        s = self.settings
        if not self.probes:
            return self._k_start
        low, high = self._bracket()
        if high is None:                         # nothing failed yet: grow
            top = max(self._ks)
            return None if top >= self._k_max else min(top + s.grow_steps, self._k_max)
        if low is None:                          # nothing passed below the lowest failure: shrink
            return None if high <= self._k_min else max(high - (s.shrink_steps or s.grow_steps), self._k_min)
        if high - low <= 1:
            return None                          # adjacent grid points: the resolution
        return (low + high) // 2

    def record(self, probe: Probe) -> None:
        """Tell the search what the probe at the last asked rate measured."""
        self._ks.append(grid_index(probe.rate_rps, self.settings.steps_per_octave))
        self.probes.append(probe)

    def curve(self, candidate: str, mix: str, slo_names: tuple[str, ...] = ()) -> CapacityCurve:
        """The answer so far (see ``CapacityCurve``)."""
        s = self.settings
        low, high = self._bracket()
        capacity = grid_rate(low, s.steps_per_octave) if low is not None else None
        failing = grid_rate(high, s.steps_per_octave) if high is not None else None
        spread = failing - capacity if capacity is not None and failing is not None else None
        return CapacityCurve(candidate, mix, s.target_share, _resolution(capacity or failing, s),
                             tuple(self.probes), capacity, spread, _decided_by(self.probes, s.target_share,
                                                                              capacity, failing))


def _resolution(rate: float | None, s: SearchSettings) -> float:
    return (rate or 1.0) * (2 ** (1 / s.steps_per_octave) - 1)


def curve_at_rates(candidate: str, mix: str, probes: list[Probe], target_share: float) -> CapacityCurve:
    """The curve of probes at given rates (not searched: ``bench slo --rates``), by the search's rule: the
    capacity is the highest passing rate below the lowest failing one; the spread, the bracket up to that
    failing rate; the resolution, the closest two rates."""
    fails = sorted(p.rate_rps for p in probes if not _passes(p, target_share))
    failing = fails[0] if fails else None
    passing = [p.rate_rps for p in probes if _passes(p, target_share) and (failing is None or p.rate_rps < failing)]
    capacity = max(passing) if passing else None
    spread = failing - capacity if capacity is not None and failing is not None else None
    rates = sorted(p.rate_rps for p in probes)
    step = min((b - a for a, b in zip(rates, rates[1:])), default=0.0)
    return CapacityCurve(candidate, mix, target_share, step, tuple(probes), capacity, spread,
                         _decided_by(probes, target_share, capacity, failing))


def _decided_by(probes, target_share: float, capacity: float | None, failing: float | None) -> str:
    if not probes:
        return "not measured"
    if failing is None:
        top = max(p.rate_rps for p in probes)
        return f"nothing failed up to {top:.3g} req/s (the capacity is at least that)"
    misses: dict[str, int] = {}
    for p in probes:
        if not _passes(p, target_share):
            for what, n in p.misses.items():
                misses[what] = misses.get(what, 0) + n
    if not misses:
        return "attainment under the target share"
    return max(misses.items(), key=lambda kv: kv[1])[0]


def combine(curves: list[CapacityCurve]) -> CapacityCurve:
    """One curve from the repeats of a search (same candidate and mix, other seeds): every probe kept, the
    capacity their median, the spread at least the repeats' range (see ``CapacityCurve``)."""
    assert curves, "no curve to combine"
    if len(curves) == 1:
        return curves[0]
    caps = [c.capacity_rps for c in curves]
    measured = [c for c in caps if c is not None]
    capacity = statistics.median(measured) if len(measured) * 2 > len(caps) else None
    spreads = [c.spread_rps for c in curves if c.capacity_rps is not None]
    if capacity is None or any(sp is None for sp in spreads):
        spread = None
    else:
        spread = max([max(measured) - min(measured), *spreads])
    decided = [c.decided_by for c in curves]
    return replace(curves[0], probes=tuple(p for c in curves for p in c.probes), capacity_rps=capacity,
                   spread_rps=spread, decided_by=max(set(decided), key=decided.count),
                   resolution_rps=max(c.resolution_rps for c in curves))


def answer_interval(curve: CapacityCurve) -> tuple[float, float]:
    """Where the edge (the highest rate meeting the target) lies, as this curve states it: a twin's interval; else
    from its capacity to its capacity plus its spread (infinite when nothing failed; from 0 when nothing passed)."""
    if curve.interval_rps is not None:
        return curve.interval_rps
    if curve.capacity_rps is None:
        failing = [p.rate_rps for p in curve.probes if not _passes(p, curve.target_share)]
        return 0.0, min(failing) if failing else math.inf
    if curve.spread_rps is None:
        return curve.capacity_rps, math.inf
    return curve.capacity_rps, curve.capacity_rps + curve.spread_rps


def within_spread(a: CapacityCurve, b: CapacityCurve) -> bool:
    """Whether two candidates' capacities cannot be told apart: the higher capacity lies within the lower one's
    answer interval, or (twins' curves, two-sided intervals) the lower one within the higher one's; where nothing
    passed for one, whether the other's capacity lies under its lowest failing rate."""
    if a.capacity_rps is None or b.capacity_rps is None:
        # nothing passed for one: its capacity lies under its lowest failing rate, which holds any capacity below it
        known = a if a.capacity_rps is not None else b
        unknown = b if known is a else a
        return known.capacity_rps is None or known.capacity_rps < answer_interval(unknown)[1]
    lo, hi = sorted((a, b), key=lambda c: c.capacity_rps)
    return hi.capacity_rps <= answer_interval(lo)[1] + 1e-12 or lo.capacity_rps >= answer_interval(hi)[0] - 1e-12
