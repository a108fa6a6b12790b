"""The recommendation: which architecture this box should serve with, the rule that decided, and why.

Pure: evidence in, a ``Recommendation`` out — no engine, no clock, no store.

The seeds' rule: recommend disaggregation only when prefill->decode
interference is *measured* on the colocated runs, AND the disaggregated run
meets both the TTFT and the per-token targets, AND it beats the best colocated
(chunked or replicated) capacity by a clear margin.  Otherwise recommend the
colocated chunk (or replica count) with the best capacity: the highest arrival
rate at which the target share of requests meets every SLO of their class
(``homepd.advise.campaign.capacity``).  Candidates whose capacities lie within each
other's measurement spread are a tie, and the answer says so.  Evidence
without capacity curves (one rate per run) is ranked by goodput instead.  This
is decided per prompt mix; the overall answer is the one for the ``mixed``
trace (the mix a box serves in practice) and the evidence says when the mixes
disagree.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from homepd.advise.campaign.capacity import CapacityCurve, answer_interval, within_spread
from homepd.twin.records import is_noise_bound
from homepd.core.modes import Candidate

# interference counts as measured when decode steps disturbed by prefill are this much slower, matched on
# batch size, over at least MIN_INTERFERENCE_SAMPLES disturbed steps
INTERFERENCE_SIGNIFICANT = 1.2
MIN_INTERFERENCE_SAMPLES = 3
# "meets the targets": this share of requests within both TTFT and TPOT
SLO_ATTAINMENT_TARGET = 0.9
# "a clear margin": disaggregated goodput at least this multiple of the best colocated goodput
DISAGG_MARGIN = 1.2
OVERALL_MIX = "mixed"
# twins' capacities this close (relative to the higher one), their intervals overlapping: either serves the box
TWIN_TIE_SHARE = 0.10


@dataclass(frozen=True)
class Measurement:
    """The figures of one run that the rule reads (one candidate, one mix, one repeat)."""
    goodput_per_s: float | None
    slo_attainment: float | None    # share of requests meeting every SLO
    ttft_attainment: float | None   # share within the TTFT target
    tpot_attainment: float | None   # share within the TPOT target
    ttft_ms_p99: float | None
    itl_ms_p99: float | None
    interference_slowdown: float | None
    interference_samples: int       # disturbed decode steps behind the slowdown
    n_requests: int
    n_failed: int = 0


@dataclass
class Evidence:
    """Every measurement, by candidate and mix; infeasible candidates carry only their reason."""
    candidates: list[Candidate]
    runs: dict[tuple[str, str], list[Measurement]] = field(default_factory=dict)  # (candidate, mix) -> repeats
    capacity: dict[tuple[str, str], CapacityCurve] = field(default_factory=dict)  # (candidate, mix) -> curve
    # (candidate, mix) -> why those runs did not exercise the candidate's architecture: shown, never ranked
    not_exercised: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, candidate: str, mix: str, m: Measurement) -> None:
        self.runs.setdefault((candidate, mix), []).append(m)

    @property
    def mixes(self) -> list[str]:
        seen: list[str] = []
        for _, mix in self.runs:
            if mix not in seen:
                seen.append(mix)
        return seen


@dataclass(frozen=True)
class Row:
    """One line of the evidence table: a candidate on a mix, medians over repeats and their spread."""
    candidate: str
    mix: str
    n_repeats: int
    n_requests: int
    goodput_per_s: float | None
    goodput_spread: float | None    # (max - min) / median over repeats
    slo_attainment: float | None
    ttft_ms_p99: float | None
    itl_ms_p99: float | None
    interference_slowdown: float | None
    interference_samples: int
    capacity_rps: float | None = None        # highest rate with the target share meeting the SLO (None: none)
    capacity_spread_rps: float | None = None
    has_curve: bool = False                  # a capacity search ran (its capacity may be None: nothing passed)
    capacity_interval_rps: tuple[float, float] | None = None  # a twin's: where the capacity lies, both sides
    from_twin: bool = False                  # the capacity is its twin's (checked and trusted), not a search's
    attainment_at_half: float | None = None  # its twin's attainment at half the capacity
    noise_bound: bool = False                # ... so low the curve is flat (``is_noise_bound``)
    below_rps: float | None = None           # nothing passed: the capacity lies under this (the lowest failing rate)

    @property
    def is_lower_bound(self) -> bool:
        """A measured capacity above which nothing failed: how much higher it goes is not known."""
        return self.capacity_rps is not None and not self.from_twin and self.capacity_spread_rps is None

    @property
    def relative_spread(self) -> float:
        """How far the capacity may be off, as a share of it: a twin's interval's half-width, a search's spread."""
        if not self.capacity_rps:
            return 0.0
        if self.capacity_interval_rps is not None:
            return (self.capacity_interval_rps[1] - self.capacity_interval_rps[0]) / 2 / self.capacity_rps
        return (self.capacity_spread_rps or 0.0) / self.capacity_rps


@dataclass(frozen=True)
class MixAnswer:
    mix: str
    candidate: str
    rule: str


@dataclass(frozen=True)
class Recommendation:
    candidate: Candidate | None
    config: dict                    # EngineConfig values to apply
    rule: str                       # which branch of the rule decided
    reason: str                     # in words, with the numbers
    confidence: str                 # "high" | "medium" | "low"
    confidence_why: str
    per_mix: tuple[MixAnswer, ...]
    mixes_agree: bool
    table: tuple[Row, ...]
    infeasible: tuple[tuple[str, str], ...]   # (candidate, reason)
    tied_with: tuple[str, ...] = ()           # candidates within the winner's measurement spread (mixed mix)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_rows(evidence: Evidence) -> list[Row]:
    rows = []
    for (name, mix), ms in evidence.runs.items():
        curve = evidence.capacity.get((name, mix))
        goodputs = [m.goodput_per_s for m in ms if m.goodput_per_s is not None]
        med = _median(goodputs)
        spread = (max(goodputs) - min(goodputs)) / med if len(goodputs) > 1 and med else None
        rows.append(Row(
            candidate=name, mix=mix, n_repeats=len(ms), n_requests=sum(m.n_requests for m in ms),
            goodput_per_s=med, goodput_spread=spread, slo_attainment=_median(m.slo_attainment for m in ms),
            ttft_ms_p99=_median(m.ttft_ms_p99 for m in ms), itl_ms_p99=_median(m.itl_ms_p99 for m in ms),
            interference_slowdown=_median(m.interference_slowdown for m in ms),
            interference_samples=sum(m.interference_samples for m in ms),
            capacity_rps=curve.capacity_rps if curve else None, capacity_spread_rps=curve.spread_rps if curve else None,
            has_curve=curve is not None, capacity_interval_rps=curve.interval_rps if curve else None,
            from_twin=curve is not None and curve.source == "twin",
            attainment_at_half=curve.attainment_at_half if curve else None,
            noise_bound=curve is not None and is_noise_bound(curve.attainment_at_half, curve.target_share),
            below_rps=_below(curve)))
    return rows


def _below(curve: CapacityCurve | None) -> float | None:
    """Where nothing passed, the rate the capacity lies under (its lowest failing probe); else None."""
    if curve is None or curve.capacity_rps is not None:
        return None
    upper = answer_interval(curve)[1]
    return upper if math.isfinite(upper) else None


def _goodput_key(row: Row):
    """Best first: capacity (when measured), then goodput, SLO attainment, then the lower p99 ITL and TTFT."""
    return (row.capacity_rps or 0.0, row.goodput_per_s or 0.0, row.slo_attainment or 0.0,
            -(row.itl_ms_p99 if row.itl_ms_p99 is not None else float("inf")),
            -(row.ttft_ms_p99 if row.ttft_ms_p99 is not None else float("inf")))


def _by_capacity(rows: list[Row]) -> bool:
    return any(r.has_curve for r in rows)


def _score(row: Row, by_capacity: bool) -> float | None:
    return row.capacity_rps if by_capacity else row.goodput_per_s


def _score_text(row: Row, by_capacity: bool) -> str:
    if not by_capacity:
        return f"{_fmt(row.goodput_per_s)} req/s"
    if row.from_twin and row.capacity_interval_rps is not None and row.capacity_rps is not None:
        lo, hi = row.capacity_interval_rps
        return f"{_fmt(row.capacity_rps)} req/s [{_fmt(lo)}-{_fmt(hi)}] (twin)"
    spread = f" ± {_fmt(row.capacity_spread_rps)}" if row.capacity_spread_rps is not None else " or more"
    if row.capacity_rps is None:
        return f"no rate passed; goodput {_fmt(row.goodput_per_s)} req/s at the slowest probe"
    return f"{_fmt(row.capacity_rps)}{spread} req/s"


def decide_mix(mix: str, rows: list[Row], by_name: dict[str, Candidate],
               measurements: dict[tuple[str, str], list[Measurement]],
               unranked: dict[str, str] | None = None) -> tuple[str | None, str, str]:
    """(winning candidate, rule id, reason) for one mix; ``unranked``: candidates that ran on it but are not in
    ``rows`` (their runs did not exercise their architecture), with why."""
    mine = [r for r in rows if r.mix == mix and by_name[r.candidate].feasible]
    by_cap = _by_capacity(mine)
    what = "capacity" if by_cap else "goodput"
    colocated = [r for r in mine if not by_name[r.candidate].mode.traits.hands_off_kv]
    disagg = [r for r in mine if by_name[r.candidate].mode.traits.hands_off_kv]
    best_co = max(colocated, key=_goodput_key, default=None)
    if best_co is None and not disagg:
        return None, "no-evidence", f"no candidate ran on the {mix} mix"
    if best_co is None:
        d = max(disagg, key=_goodput_key)
        return d.candidate, "only-disaggregated", "only the disaggregated architecture ran on this mix"
    chunked = [r for r in colocated if by_name[r.candidate].mode.traits.single_worker] or colocated
    # the strongest interference among runs with enough disturbed steps to trust it (else the best sampled)
    sampled = [r for r in chunked if r.interference_samples >= MIN_INTERFERENCE_SAMPLES]
    inter = max(sampled, key=lambda r: r.interference_slowdown or 0.0) if sampled else \
        max(chunked, key=lambda r: (r.interference_samples, r.interference_slowdown or 0.0))
    significant = (inter.interference_slowdown or 0.0) >= INTERFERENCE_SIGNIFICANT \
        and inter.interference_samples >= MIN_INTERFERENCE_SAMPLES
    co_text = f"{best_co.candidate} has the best {what} without disaggregation ({_score_text(best_co, by_cap)})"
    if not disagg:
        # why name them: a disaggregated candidate that ran but handed off no KV was measured, as one colocated
        # worker; "not measured" sent a user looking for a run that is in the evidence
        ran = [f"{name} ran but is not ranked ({why})" for name, why in (unranked or {}).items()
               if by_name[name].mode.traits.hands_off_kv]
        return best_co.candidate, f"colocated-best-{what}", co_text + "; " + (
            "; ".join(ran) if ran else "disaggregation was not measured")
    d = max(disagg, key=_goodput_key)
    ms = measurements.get((d.candidate, mix), [])
    ttft_ok = _median(m.ttft_attainment for m in ms) or 0.0
    tpot_ok = _median(m.tpot_attainment for m in ms) or 0.0
    meets = ttft_ok >= SLO_ATTAINMENT_TARGET and tpot_ok >= SLO_ATTAINMENT_TARGET
    d_score, co_score = _score(d, by_cap) or 0.0, _score(best_co, by_cap)
    margin = d_score / co_score if co_score else (float("inf") if d_score > 0 else 0.0)
    if not significant:
        return best_co.candidate, "interference-not-significant", (
            f"interference is not significant (x{_fmt(inter.interference_slowdown)} over "
            f"{inter.interference_samples} disturbed steps, needs x{INTERFERENCE_SIGNIFICANT} over "
            f">= {MIN_INTERFERENCE_SAMPLES}); {co_text}")
    if not meets:
        return best_co.candidate, "disaggregated-misses-slo", (
            f"interference is measured (x{_fmt(inter.interference_slowdown)}), but disaggregated serving meets "
            f"the TTFT target for {ttft_ok:.0%} and the per-token target for {tpot_ok:.0%} of requests (needs "
            f"{SLO_ATTAINMENT_TARGET:.0%} each); {co_text}")
    if by_cap and best_co.is_lower_bound:
        # why: nothing failed on the colocated search (its budget ended first): how far disaggregation is ahead
        # cannot be told, and it is adopted only with a clear margin
        return best_co.candidate, "disaggregated-no-clear-margin", (
            f"interference is measured and disaggregated serving meets both targets, but the best colocated "
            f"{what} is only a lower bound ({_score_text(best_co, by_cap)}: nothing failed), so its margin "
            f"({_score_text(d, by_cap)}) cannot be told from the x{DISAGG_MARGIN} needed; {co_text}")
    if by_cap and best_co.capacity_rps is None and best_co.below_rps is not None and d_score < best_co.below_rps:
        # why: a colocated candidate whose twin failed its check and whose one measured probe failed has a capacity
        # somewhere under that probe, not 0: a disaggregated twin's capacity under the same rate is not ahead of it
        # (a quick run answered "disaggregated-wins, x inf" from one failed colocated check at 0.65 req/s against
        # a disaggregated 0.41)
        return best_co.candidate, "disaggregated-no-clear-margin", (
            f"interference is measured and disaggregated serving meets both targets ({_score_text(d, by_cap)}), "
            f"but no rate passed for {best_co.candidate}, whose capacity lies somewhere under "
            f"{_fmt(best_co.below_rps)} req/s: disaggregation's margin over it cannot be told (a full campaign "
            f"measures lower rates); {co_text}")
    if margin < DISAGG_MARGIN:
        return best_co.candidate, "disaggregated-no-clear-margin", (
            f"interference is measured and disaggregated serving meets both targets, but its {what} "
            f"({_score_text(d, by_cap)}) is x{_fmt(margin)} the best colocated one, under the "
            f"x{DISAGG_MARGIN} margin; {co_text}")
    return d.candidate, "disaggregated-wins", (
        f"interference is measured (x{_fmt(inter.interference_slowdown)} over {inter.interference_samples} "
        f"disturbed steps), disaggregated serving meets TTFT for {ttft_ok:.0%} and the per-token target for "
        f"{tpot_ok:.0%} of requests, and its {what} {_score_text(d, by_cap)} is x{_fmt(margin)} the best "
        f"colocated ({best_co.candidate}, {_score_text(best_co, by_cap)})")


def ties(evidence: Evidence, mix: str, winner: str) -> list[str]:
    """The feasible candidates whose capacity on ``mix`` cannot be told from ``winner``'s (``within_spread``)."""
    win = evidence.capacity.get((winner, mix))
    if win is None:
        return []
    feasible = {c.name for c in evidence.candidates if c.feasible}
    return [name for (name, m), curve in evidence.capacity.items()
            if m == mix and name != winner and name in feasible and (name, m) not in evidence.not_exercised
            and within_spread(win, curve)]


def recommend(evidence: Evidence) -> Recommendation:
    """Apply the rule per mix and overall; grade the confidence from repeats, margins and spreads."""
    by_name = {c.name: c for c in evidence.candidates}
    table = summarize_rows(evidence)
    rows = [r for r in table if (r.candidate, r.mix) not in evidence.not_exercised]  # ranked: what ran as named
    per_mix = []
    reasons = {}
    for mix in evidence.mixes:
        name, rule, reason = decide_mix(mix, rows, by_name, evidence.runs,
                                        {c: why for (c, m), why in evidence.not_exercised.items() if m == mix})
        if name is not None:
            per_mix.append(MixAnswer(mix, name, rule))
            reasons[mix] = (name, rule, reason)
    infeasible = tuple((c.name, c.reason) for c in evidence.candidates if not c.feasible)
    if not per_mix:
        return Recommendation(None, {}, "no-evidence", "nothing could be measured on this box", "low",
                              "no runs", (), True, tuple(table), infeasible)
    overall_mix = OVERALL_MIX if OVERALL_MIX in reasons else per_mix[0].mix
    name, rule, reason = reasons[overall_mix]
    agree = len({a.candidate for a in per_mix}) == 1
    if not agree:
        reason += "; the answer differs by prompt mix: " + ", ".join(f"{a.mix} -> {a.candidate}" for a in per_mix)
    tied = ties(evidence, overall_mix, name)
    row_of = {r.candidate: r for r in rows if r.mix == overall_mix}
    twin_tie = _twin_tie(row_of, name, tied)
    if twin_tie is not None:
        within, names = twin_tie
        reason += (f"; {_and(names)} are within {within:.0%} of each other: either serves this box ("
                   + ", ".join(_score_text(row_of[n], True) for n in names) + ")")
        confidence, why = "medium", (f"within {within:.0%}: either serves this box (the twins' capacities, each "
                                     f"checked against measurement)")
    elif tied:
        if row_of[name].capacity_rps is None:
            reason += f"; {_and([name, *tied])} are within the measurement spread (no rate passed for any)"
        else:
            reason += (f"; {_and([name, *tied])} are within the measurement spread ("
                       + ", ".join(_score_text(row_of[n], True) for n in [name, *tied] if n in row_of) + ")")
        confidence, why = "low", f"a tie: {_and([name, *tied])} are within the measurement spread"
    else:
        confidence, why = _confidence(rows, overall_mix, name)
    cand = by_name[name]
    return Recommendation(cand, cand.config_values(), rule, f"on the {overall_mix} mix: {reason}", confidence, why,
                          tuple(per_mix), agree, tuple(table), infeasible, tuple(tied))


def _twin_tie(row_of: dict[str, Row], winner: str, tied: list[str]) -> tuple[float, list[str]] | None:
    """(how close, names) when the winner and those tied with it are all twins' capacities within
    ``TWIN_TIE_SHARE`` of the highest: a narrow answer, not a coin toss.  None otherwise."""
    names = [winner, *tied]
    rows = [row_of.get(n) for n in names]
    if not tied or any(r is None or not r.from_twin or not r.capacity_rps for r in rows):
        return None
    top = max(r.capacity_rps for r in rows)
    within = (top - min(r.capacity_rps for r in rows)) / top
    return (within, names) if within <= TWIN_TIE_SHARE else None


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _confidence(rows: list[Row], mix: str, winner: str) -> tuple[str, str]:
    mine = sorted((r for r in rows if r.mix == mix), key=_goodput_key, reverse=True)
    by_cap = _by_capacity(mine)
    win = next(r for r in mine if r.candidate == winner)
    rest = [r for r in mine if r.candidate != winner]
    if not rest:
        return "low", "only one candidate is ranked"
    second = rest[0]
    w, x = _score(win, by_cap) or 0.0, _score(second, by_cap) or 0.0
    gap = (w - x) / max(w, 1e-9)
    if by_cap:
        spread = max(win.relative_spread, second.relative_spread * (x / max(w, 1e-9)))
    else:
        spread = max(win.goodput_spread or 0.0, second.goodput_spread or 0.0)
    if win.from_twin and second.from_twin and win.capacity_interval_rps and second.capacity_interval_rps:
        apart = win.capacity_interval_rps[0] > second.capacity_interval_rps[1]
        flat = [r for r in (win, second) if r.noise_bound]
        if apart and gap >= 0.1 and flat:
            return "medium", (f"{gap:.0%} ahead of {second.candidate} and the twins' intervals are apart, but "
                              + "; ".join(f"{r.candidate} meets the SLO for only {r.attainment_at_half:.0%} of "
                                          "requests at half its capacity" for r in flat)
                              + ": its misses are the box's step-time noise against the budget more than load, so "
                              "its capacity moves with each calibration")
        if apart and gap >= 0.1:
            return "high", (f"the twins' intervals are apart: {win.candidate} {_score_text(win, True)} against "
                            f"{second.candidate} {_score_text(second, True)}, {gap:.0%} ahead (each twin checked "
                            f"against measured probes)")
        return "medium", (f"{gap:.0%} ahead of {second.candidate}, but the twins' intervals overlap ("
                          f"{_score_text(win, True)} against {_score_text(second, True)})")
    n = f"{win.n_repeats} repeat(s), {win.n_requests} requests"
    what = "measurement" if by_cap else "repeat"
    if win.n_repeats >= 2 and gap > spread and gap >= 0.1:
        return "high", f"{n}; {gap:.0%} ahead of {second.candidate}, more than the {spread:.0%} {what} spread"
    if gap >= 0.2:
        return "medium", f"{n}; {gap:.0%} ahead of {second.candidate}" + (
            "" if win.n_repeats >= 2 else " (one repeat: spread unknown)")
    return "low", f"{n}; only {gap:.0%} ahead of {second.candidate}" + (
        f", within the {spread:.0%} {what} spread" if spread else "")


def _fmt(x) -> str:
    return "NA" if x is None else f"{x:.2f}"
