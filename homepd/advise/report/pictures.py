"""What the advise pictures draw of a run (``homepd.store.records.Run``: a stored one, or a live result's
``AdviseResult.run``): capacity curves, latency distributions and the two-box projection.

One type in, so one code path serves the app, the image file and ``homepd history show --plot``.  Capacity
curves are the advice's (a run stored before them draws no curve).  Pure: no plotting library, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from homepd.advise.report.twobox import HandoffSample, TwoBoxProjection, project
from homepd.core.modes import Mode
from homepd.core.records import to_plain
from homepd.stats import percentile
from homepd.measure.curve import CapacityCurve as SearchCurve
from homepd.store.records import RequestTimeline, Run
from homepd.twin.records import CALIBRATION_MIX

RECOVERY_MARK = "+kill"     # the recovery scenario's runs (candidate and mix carry it): not a latency picture
PROBE_MARK = "@"            # a stored capacity probe's mix: "mixed@0.5/s"
MIN_TWIN_SEEDS = 4          # a twin's rate is drawn where at least this many of its seeds ran


@dataclass(frozen=True)
class CapacityCurve:
    """Attainment against arrival rate for one candidate on one mix (from the capacity search's plain dict)."""
    candidate: str
    mix: str
    target_share: float
    points: tuple[tuple[float, float], ...]     # (rate req/s, attainment 0..1), by rate
    capacity_rps: float | None
    spread_rps: float | None
    decided_by: str


@dataclass(frozen=True)
class TwinCurve:
    """One candidate's twin on one mix, as drawn: the median attainment of the seeds run at each rate with the
    seeds' 10th to 90th percentile (the band), its capacity and interval, and every check (a measured probe's
    attainment beside the twin's prediction of that very trace)."""
    candidate: str
    mix: str
    target_share: float
    points: tuple[tuple[float, float, float, float], ...]   # (rate req/s, median, p10, p90), by rate
    capacity_rps: float | None
    interval_rps: tuple[float, float] | None
    checks: tuple[tuple[float, float, float], ...]          # (rate req/s, measured, twin's prediction)
    trusted: bool
    error_points: float | None                             # the median attainment error over the checks

    def label(self) -> str:
        if self.capacity_rps is None:
            head = f"{self.candidate} twin: no capacity found"
        else:
            iv = f" [{self.interval_rps[0]:.2f}-{self.interval_rps[1]:.2f}]" if self.interval_rps else ""
            head = f"{self.candidate} twin: {self.capacity_rps:.2f}{iv} req/s"
        if self.error_points is None:
            return head + ", not checked"
        return head + f", off {self.error_points:.0f} pts" + ("" if self.trusted else " (not trusted)")


@dataclass(frozen=True)
class Latencies:
    """One candidate's measured latencies on one mix, every repeat pooled (ms); with a capacity search, those
    of the probe at its capacity (what the evidence table shows)."""
    candidate: str
    mix: str
    ttft_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]       # every gap between two tokens


@dataclass(frozen=True)
class Pictures:
    """Everything the pictures draw for one advise run."""
    title: str
    curves: tuple[CapacityCurve, ...]
    latencies: tuple[Latencies, ...]
    projections: tuple[TwoBoxProjection, ...]
    twins: tuple[TwinCurve, ...] = ()

    @property
    def mixes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*(c.mix for c in self.curves), *(t.mix for t in self.twins),
                                    *(lat.mix for lat in self.latencies)]))

    @property
    def candidates(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*(c.candidate for c in self.curves), *(t.candidate for t in self.twins),
                                    *(lat.candidate for lat in self.latencies)]))


@dataclass(frozen=True)
class RunData:
    """One measured probe (a candidate, a mix, a repeat) and its requests."""
    candidate: str
    mode: Mode | None
    mix: str
    requests: tuple[RequestTimeline, ...]


# ---- reading --------------------------------------------------------------------------------

def read_curve(curve: SearchCurve) -> CapacityCurve:
    """A capacity search's curve as the pictures draw it: one point per rate."""
    at: dict[float, list[float]] = {}
    for p in curve.probes:
        at.setdefault(round(p.rate_rps, 9), []).append(p.attainment)
    # why the mean: the repeats probe some rates on two seeds; one point per rate keeps the curve a curve
    points = sorted((rate, sum(a) / len(a)) for rate, a in at.items())
    return CapacityCurve(curve.candidate, curve.mix, curve.target_share, tuple(points), curve.capacity_rps,
                         curve.spread_rps, curve.decided_by)


def run_curves(run: Run) -> tuple[CapacityCurve, ...]:
    """The capacity curves of ``run``'s advice, first of each candidate x mix kept (a run stored before the
    curves were: none)."""
    found: dict[tuple[str, str], CapacityCurve] = {}
    for curve in run.advice.capacity if run.advice is not None else ():
        found.setdefault((curve.candidate, curve.mix), read_curve(curve))
    return tuple(found.values())


def run_twins(run: Run) -> tuple[TwinCurve, ...]:
    """Each candidate's twin on each mix it simulated, with its checks on that mix (none before the twin)."""
    out = []
    for twin in run.advice.twins if run.advice is not None else ():
        for cap in twin.capacities:
            # why rates with at least MIN_TWIN_SEEDS seeds: a seed's bisection runs near its own capacity, so a
            # rate that one or two seeds ran is their story, not the twin's
            points = tuple((p.rate_rps, percentile(p.by_seed, 50), percentile(p.by_seed, 10),
                            percentile(p.by_seed, 90)) for p in sorted(cap.points, key=lambda p: p.rate_rps)
                           if len(p.by_seed) >= min(MIN_TWIN_SEEDS, cap.n_seeds))
            checks = tuple((c.rate_rps, c.measured_attainment, c.predicted_attainment) for c in twin.checks
                           if c.mix == cap.mix or (not c.mix and len(twin.capacities) == 1))
            out.append(TwinCurve(twin.candidate, cap.mix, cap.target_share, points, cap.capacity_rps,
                                 cap.interval_rps, checks, twin.trusted, twin.attainment_error_points))
    return tuple(out)


def split_probe(mix: str) -> tuple[str, float | None]:
    """A stored probe's mix ``"mixed@0.5/s"`` -> ``("mixed", 0.5)``; any other mix -> ``(mix, None)``."""
    base, sep, rate = mix.partition(PROBE_MARK)
    try:
        return (base, float(rate.removesuffix("/s"))) if sep else (mix, None)
    except ValueError:
        return mix, None


def at_capacity(runs: list[RunData], curves: tuple[CapacityCurve, ...]) -> list[RunData]:
    """The stored probes of each candidate x mix reduced to the one at its capacity (as the live result keeps
    them: where no probe passed, its lowest), renamed to the plain mix; other runs as they are."""
    capacity = {(c.candidate, c.mix): c.capacity_rps for c in curves}
    probes: dict[tuple[str, str], list[tuple[float, RunData]]] = {}
    out = []
    for run in runs:
        base, rate = split_probe(run.mix)
        if rate is None:
            out.append(run)
        else:
            probes.setdefault((run.candidate, base), []).append((rate, run))
    for (cand, base), rated in probes.items():
        target = capacity.get((cand, base))
        target = min(r for r, _ in rated) if target is None else target
        # why the nearest: the stored name rounds the rate to 3 significant digits
        best = min(abs(r - target) for r, _ in rated)
        out += [RunData(run.candidate, run.mode, base, run.requests) for r, run in rated if abs(r - target) == best]
    return out


def measured_runs(run: Run) -> list[RunData]:
    """The measured probes of ``run`` (read with timelines: the latencies need every token); a capacity
    search's probes (stored one per rate, ``mix@rate/s``) reduced to the probe at each capacity."""
    out = [RunData(p.candidate, p.architecture, p.mix or "-", p.requests) for p in run.measured
           if p.mix != CALIBRATION_MIX]
    return at_capacity(out, run_curves(run))


# ---- deriving -------------------------------------------------------------------------------

def latencies(runs: list[RunData]) -> tuple[Latencies, ...]:
    """TTFT and every inter-token gap of the finished requests, per candidate and mix (recovery runs left out)."""
    pooled: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for run in runs:
        if RECOVERY_MARK in run.candidate or RECOVERY_MARK in run.mix:
            continue
        ttft, itl = pooled.setdefault((run.candidate, run.mix), ([], []))
        for req in _finished(run.requests):
            if req.timings.ttft_s is not None:
                ttft.append(req.timings.ttft_s * 1e3)
            times = req.token_times_s
            itl.extend((b - a) * 1e3 for a, b in zip(times, times[1:]))
    return tuple(Latencies(c, m, tuple(sorted(t)), tuple(sorted(i))) for (c, m), (t, i) in pooled.items())


def projections(runs: list[RunData], *, ttft_budget_ms: float, target_share: float = 0.9
                ) -> tuple[TwoBoxProjection, ...]:
    """The two-box projection of every disaggregated candidate on every mix it ran."""
    grouped: dict[tuple[str, str], list[RunData]] = {}
    for run in runs:
        if run.mode is not None and run.mode.traits.hands_off_kv and RECOVERY_MARK not in run.mix:
            grouped.setdefault((run.candidate, run.mix), []).append(run)
    out = []
    for (cand, mix), rs in grouped.items():
        done = [req for run in rs for req in _finished(run.requests)]
        samples = [HandoffSample(req.timings.n_prompt_tokens, req.timings.kv_bytes, req.timings.ttft_s,
                                 req.is_interactive) for req in done]
        handoff_ms = [req.timings.kv_transfer_s * 1e3 for req in done if req.timings.kv_transfer_s is not None]
        out.append(project(cand, mix, samples, ttft_budget_ms=ttft_budget_ms, target_share=target_share,
                           measured_handoff_ms=handoff_ms))
    return tuple(out)


def run_pictures(run: Run) -> Pictures:
    """The pictures of one advise run, live or stored (read with timelines: the gaps need every token)."""
    title = f"advise run {run.id}" if run.id is not None else "advise run (not stored)"
    runs = measured_runs(run)
    return Pictures(title, run_curves(run), latencies(runs), projections(runs, ttft_budget_ms=run.config.budgets_ms[0]),
                    run_twins(run))


def cdf(values_ms: tuple[float, ...], max_points: int = 200) -> tuple[list[float], list[float]]:
    """(x ms, share of values <= x) of sorted ``values_ms``, thinned to at most ``max_points`` (ends kept)."""
    n = len(values_ms)
    if n == 0:
        return [], []
    idx = range(n) if n <= max_points else sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [values_ms[i] for i in idx], [(i + 1) / n for i in idx]


def p99(values_ms: tuple[float, ...]) -> float | None:
    return percentile(list(values_ms), 99)


def _finished(requests: tuple[RequestTimeline, ...]) -> list[RequestTimeline]:
    return [r for r in requests if r.is_finished]


def run_projections(run: Run) -> tuple[TwoBoxProjection, ...]:
    """The two-box rows of ``run``'s disaggregated probes (projected, not measured)."""
    return projections(measured_runs(run), ttft_budget_ms=run.config.budgets_ms[0])


def projections_plain(run: Run) -> list[dict]:
    """``run_projections`` as JSON-ready data (each row says ``"note": "projected, not measured"``)."""
    return to_plain(list(run_projections(run)))
