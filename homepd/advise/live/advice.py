"""Live advice: the running service's traffic profile against the stored capacity curves.

Pure: a ``WindowProfile`` (``homepd.measure.profile``), the ``LiveEvidence`` of the latest advise run and the
name of the running candidate in; a ``Verdict`` out (``judge``).  ``AdviceTracker`` adds the hysteresis: a
verdict becomes advice (an event) only when it has held for ``hysteresis_s``.

**The rule.**
1. Too few requests in the window (``min_requests``): nothing is judged (``quiet``).
2. The profile is matched to the measured mix whose shape is nearest (``shape_distance``: the share of long
   prompts, the background share, the median prompt and the mean output, in octaves).  Farther than
   ``max_distance``, or prompts longer than any measured (p90 over ``prompt_over_factor`` x the longest
   mix's p90): ``unmeasured``, with the command that measures it (``homepd advise --traffic service``).
3. On that mix, each candidate's capacity is read at the live rate (headroom: capacity / rate; or the rate
   at which it broke).  The best candidate is advised (``switch``) only when its capacity is above the
   running one's answer interval (``capacity.within_spread``: more than the measured spread).
4. Otherwise, when the live rate is above the running candidate's capacity: ``at-capacity`` (with nothing
   better measured); a live rate above its capacity when none of its probes failed (the capacity is then only
   a lower bound) is ``unmeasured``.  Else ``keep``.
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field, replace

from homepd.advise.live.twinned import Replay, twin_verdict
from homepd.measure.profile import WindowProfile
from homepd.twin.records import TwinEvidence

OFFER = "homepd advise --traffic service:{since}"


class AdviceKind(enum.StrEnum):
    KEEP = "keep"                # the running candidate is the best measured (or tied)
    SWITCH = "switch"            # another candidate measured better by more than the spread
    AT_CAPACITY = "at-capacity"  # the running candidate is predicted to miss its SLO, nothing better measured
    UNMEASURED = "unmeasured"    # the traffic lies outside the evidence
    QUIET = "quiet"              # too few requests to judge
    NO_EVIDENCE = "no-evidence"  # no advise run for this model in the store


@dataclass(frozen=True)
class MixShape:
    """The shape of the requests a mix's capacity curves were measured on (from the stored probes)."""
    mix: str
    n_requests: int
    long_share: float
    background_share: float
    prompt_tokens_p50: float
    prompt_tokens_p90: float
    mean_output_tokens: float


@dataclass(frozen=True)
class EvidenceRow:
    """One stored capacity curve: a candidate on a mix."""
    run_id: int
    candidate: str
    mix: str
    capacity_rps: float | None       # None: no rate passed
    spread_rps: float | None         # None: nothing failed above the capacity (a lower bound)
    max_probed_rps: float
    decided_by: str = ""

    @property
    def failing_rps(self) -> float:
        """The upper end of its answer interval (where it broke; inf when nothing failed)."""
        if self.capacity_rps is None:
            return 0.0
        return math.inf if self.spread_rps is None else self.capacity_rps + self.spread_rps

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class LiveEvidence:
    run_id: int
    model: str
    rows: tuple[EvidenceRow, ...]
    shapes: dict[str, MixShape]
    configs: dict[str, dict] = field(default_factory=dict)   # candidate -> EngineConfig values (feasible ones)
    measured_on: str | None = None   # the box the run was measured on (BoxIdentity.describe), when it says
    foreign: str | None = None       # why its capacities do not hold here (measured on another box), else None
    twins: tuple[TwinEvidence, ...] = ()  # the run's calibrated candidates: today's traffic is replayed on them

    def rows_on(self, mix: str) -> list[EvidenceRow]:
        return [r for r in self.rows if r.mix == mix and (not self.configs or r.candidate in self.configs)]


@dataclass(frozen=True)
class LiveSettings:
    window_s: float = 300.0          # the window the advice is judged on
    hysteresis_s: float = 120.0      # a verdict must hold this long to become advice
    min_requests: int = 10
    max_distance: float = 0.6
    prompt_over_factor: float = 1.5


@dataclass(frozen=True)
class Headroom:
    candidate: str
    capacity_rps: float | None
    spread_rps: float | None
    headroom: float | None           # capacity / live rate (> 1: room left)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Verdict:
    """What the evidence says about the live traffic now (see the module docstring)."""
    kind: AdviceKind
    candidate: str | None            # the advised candidate (switch), else the running one
    running: str | None
    mix: str | None
    reason: str
    confidence: str = "low"          # high | medium | low
    margin_rps: float | None = None  # advised capacity - running capacity
    evidence: tuple[EvidenceRow, ...] = ()
    headroom: tuple[Headroom, ...] = ()
    live: WindowProfile | None = None
    distance: float | None = None
    offer: str | None = None         # a command that would measure what is missing
    projected: tuple[Replay, ...] = ()  # today's traffic in each candidate's twin (homepd.advise.live.twinned)

    @property
    def key(self) -> tuple[AdviceKind, str | None]:
        return self.kind, self.candidate

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("kind", "candidate", "running", "mix", "reason", "confidence",
                                             "margin_rps", "distance", "offer")}
        out["kind"] = self.kind.value
        out["evidence"] = [r.to_dict() for r in self.evidence]
        out["headroom"] = [h.to_dict() for h in self.headroom]
        out["live"] = self.live.to_dict() if self.live is not None else None
        out["projected"] = [r.to_dict() for r in self.projected]
        return out


def shape_distance(live: WindowProfile, shape: MixShape) -> float:
    """How far the live traffic is from a mix's shape: share differences plus octaves (/4) of the median prompt
    and the mean output."""
    octaves = (lambda a, b: abs(math.log2(max(a or 1.0, 1.0) / max(b, 1.0))) / 4)
    return (abs((live.long_share or 0.0) - shape.long_share)
            + abs((live.background_share or 0.0) - shape.background_share)
            + octaves(live.prompt_tokens.get("p50"), shape.prompt_tokens_p50)
            + octaves(live.mean_output_tokens, shape.mean_output_tokens))


def judge(live: WindowProfile, evidence: LiveEvidence | None, running: str | None,
          settings: LiveSettings = LiveSettings()) -> Verdict:
    """The verdict on ``live`` (no hysteresis: ``AdviceTracker``)."""
    base = Verdict(AdviceKind.QUIET, running, running, None, "", live=live)
    since = f"{max(1, math.ceil(live.window_s / 60))}m"
    if evidence is not None and evidence.foreign:
        return replace(base, kind=AdviceKind.NO_EVIDENCE, offer="homepd advise", reason=evidence.foreign)
    if evidence is None or not evidence.rows:
        return replace(base, kind=AdviceKind.NO_EVIDENCE, offer="homepd advise",
                       reason="no advise run for this model in the store: nothing to compare the traffic with")
    if live.n_requests < settings.min_requests:
        return replace(base, reason=f"{live.n_requests} request(s) in the last {live.window_s:g} s; advice needs "
                                    f"{settings.min_requests}")
    shapes = [s for s in evidence.shapes.values() if evidence.rows_on(s.mix)]
    if not shapes:
        return replace(base, kind=AdviceKind.NO_EVIDENCE, offer="homepd advise",
                       reason=f"run {evidence.run_id} holds no request shapes to match the traffic to")
    nearest = min(shapes, key=lambda s: shape_distance(live, s))
    distance = shape_distance(live, nearest)
    base = replace(base, mix=nearest.mix, distance=distance)
    longest = max(s.prompt_tokens_p90 for s in shapes)
    p90 = live.prompt_tokens.get("p90") or 0.0
    if p90 > settings.prompt_over_factor * longest or distance > settings.max_distance:
        why = (f"prompts up to {p90:.0f} tokens (p90), longer than any measured mix ({longest:.0f})"
               if p90 > settings.prompt_over_factor * longest else
               f"no measured mix is like it (nearest: {nearest.mix}, distance {distance:.2f} > "
               f"{settings.max_distance:g})")
        return replace(base, kind=AdviceKind.UNMEASURED, offer=OFFER.format(since=since),
                       reason=f"the traffic of the last {live.window_s:g} s lies outside the evidence: {why}")
    rows = evidence.rows_on(nearest.mix)
    rate = live.rate_rps
    headroom = tuple(Headroom(r.candidate, r.capacity_rps, r.spread_rps,
                              (r.capacity_rps / rate) if r.capacity_rps is not None and rate > 0 else None)
                     for r in sorted(rows, key=lambda r: -(r.capacity_rps or 0.0)))
    base = replace(base, headroom=headroom)
    mine = next((r for r in rows if r.candidate == running), None)
    if mine is None:
        return replace(base, kind=AdviceKind.UNMEASURED, offer=OFFER.format(since=since), evidence=tuple(rows),
                       reason=f"the running configuration ({running or 'unknown'}) was not measured on the "
                              f"{nearest.mix} mix")
    best = max(rows, key=lambda r: (r.capacity_rps or 0.0, r.candidate == running))
    live_text = f"{rate:.2f} req/s over the last {live.window_s:g} s ({live.n_requests} requests)"
    if best.candidate != running and (best.capacity_rps or 0.0) > mine.failing_rps + 1e-12:
        margin = best.capacity_rps - (mine.capacity_rps or 0.0)
        spread = max(best.spread_rps or 0.0, mine.spread_rps or 0.0)
        strained = "; the running one is past its capacity at this rate" if rate > (mine.capacity_rps or 0.0) else ""
        return replace(base, kind=AdviceKind.SWITCH, candidate=best.candidate, margin_rps=margin,
                       evidence=(best, mine), confidence=_confidence(margin, spread, live, distance, settings),
                       reason=f"the traffic looks like the {nearest.mix} mix (distance {distance:.2f}), where "
                              f"{best.candidate} measured {_cap(best)} and the running {running} {_cap(mine)} "
                              f"(run {evidence.run_id}): {margin:.2f} req/s more, beyond the measured spread; "
                              f"live {live_text}{strained}")
    if mine.capacity_rps is not None and mine.spread_rps is None and rate > mine.capacity_rps:
        return replace(base, kind=AdviceKind.UNMEASURED, offer=OFFER.format(since=since), evidence=(mine,),
                       reason=f"live {live_text} is above every rate {running} was shown to hold on the "
                              f"{nearest.mix} mix ({mine.capacity_rps:.2f} req/s, probed up to "
                              f"{mine.max_probed_rps:.2f}; no probe failed): its capacity there is unknown")
    if mine.capacity_rps is None or rate > mine.capacity_rps:
        sure = rate >= mine.failing_rps
        return replace(base, kind=AdviceKind.AT_CAPACITY, evidence=(mine,), confidence="high" if sure else "medium",
                       margin_rps=(mine.capacity_rps or 0.0) - rate,
                       reason=f"at capacity: live {live_text} is above what {running} holds on the {nearest.mix} "
                              f"mix ({_cap(mine)}, run {evidence.run_id})"
                              + (f", at or past the rate where it failed ({mine.failing_rps:.2f} req/s)" if sure else "")
                              + "; no measured candidate does better by more than the spread")
    room = mine.capacity_rps / rate if rate > 0 else math.inf
    return replace(base, kind=AdviceKind.KEEP, evidence=(mine,) + ((best,) if best is not mine else ()),
                   confidence="high" if distance < 0.2 else "medium", margin_rps=mine.capacity_rps - rate,
                   reason=f"keep {running}: on the {nearest.mix} mix it measured {_cap(mine)} (run "
                          f"{evidence.run_id}), x{room:.1f} the live {live_text}"
                          + (f"; {best.candidate} ({_cap(best)}) is within the spread" if best is not mine else ""))


def judge_replayed(live: WindowProfile, evidence: LiveEvidence, running: str | None, replays: list[Replay],
                   settings: LiveSettings = LiveSettings()) -> Verdict:
    """The verdict from today's traffic replayed in each calibrated candidate's twin (``twin_verdict``), in place
    of the nearest measured mix's capacities; quiet with too few requests, as ``judge``."""
    base = Verdict(AdviceKind.QUIET, running, running, "today's traffic", "", live=live, projected=tuple(replays))
    if live.n_requests < settings.min_requests:
        return replace(base, reason=f"{live.n_requests} request(s) in the last {live.window_s:g} s; advice needs "
                                    f"{settings.min_requests}")
    kind, candidate, reason = twin_verdict(replays, running)
    mine = next((r for r in replays if r.candidate == running), None)
    best = next((r for r in replays if r.candidate == candidate), None)
    margin = best.attainment - mine.attainment if best is not None and mine is not None else None
    sure = all(r.trusted for r in replays) and live.n_requests >= 3 * settings.min_requests
    return replace(base, kind=AdviceKind(kind), candidate=candidate, margin_rps=None,
                   confidence="high" if sure and (margin is None or margin >= 0.2) else "medium",
                   reason=f"{reason} (run {evidence.run_id}'s calibration)"
                          + (f"; {margin:+.0%} attainment" if margin and kind == "switch" else ""))


def _cap(r: EvidenceRow) -> str:
    if r.capacity_rps is None:
        return "no passing rate"
    return f"{r.capacity_rps:.2f} " + ("or more" if r.spread_rps is None else f"± {r.spread_rps:.2f}") + " req/s"


def _confidence(margin: float, spread: float, live: WindowProfile, distance: float, s: LiveSettings) -> str:
    if margin > 2 * spread and live.n_requests >= 3 * s.min_requests and distance < 0.2:
        return "high"
    return "medium" if margin > 2 * spread or distance < 0.2 else "low"


@dataclass(frozen=True)
class AdviceEvent:
    """A verdict that held for the hysteresis window: what ``/advice``'s history and ``/events`` carry."""
    verdict: Verdict
    raised_unix_s: float
    held_since_unix_s: float
    seq: int

    def to_dict(self) -> dict:
        return {**self.verdict.to_dict(), "raised_unix_s": self.raised_unix_s,
                "held_since_unix_s": self.held_since_unix_s, "seq": self.seq}


class AdviceTracker:
    """The hysteresis: ``update(verdict, now)`` returns an ``AdviceEvent`` when a verdict other than the one
    standing has held for ``hysteresis_s`` (quiet verdicts change nothing), else None."""

    RAISED = (AdviceKind.SWITCH, AdviceKind.AT_CAPACITY, AdviceKind.UNMEASURED, AdviceKind.KEEP,
              AdviceKind.NO_EVIDENCE)

    def __init__(self, running: str | None, hysteresis_s: float, history: int = 50):
        self.hysteresis_s = hysteresis_s
        self.standing: tuple[AdviceKind, str | None] = (AdviceKind.KEEP, running)
        self.current: AdviceEvent | None = None
        self._pending: tuple[tuple[AdviceKind, str | None], float] | None = None
        self.history: deque[AdviceEvent] = deque(maxlen=history)
        self._seq = 0

    def reset(self, running: str | None) -> None:
        """A new running configuration (applied advice): the standing verdict is keeping it."""
        self.standing, self._pending, self.current = (AdviceKind.KEEP, running), None, None

    def update(self, verdict: Verdict, now_unix_s: float) -> AdviceEvent | None:
        if verdict.kind not in self.RAISED:
            return None
        if verdict.key == self.standing:
            self._pending = None
            return None
        if self._pending is None or self._pending[0] != verdict.key:
            self._pending = (verdict.key, now_unix_s)
        since = self._pending[1]
        if now_unix_s - since < self.hysteresis_s:
            return None
        self._seq += 1
        event = AdviceEvent(verdict, now_unix_s, since, self._seq)
        self.standing, self._pending, self.current = verdict.key, None, event
        self.history.append(event)
        return event


def running_candidate(config, evidence: LiveEvidence | None, applied: str | None = None) -> str | None:
    """The candidate a configuration is: ``applied`` (the one advice applied), else the first of the evidence
    whose ``EngineConfig`` values ``config`` has; None when it matches none."""
    if applied:
        return applied
    for name, values in (evidence.configs if evidence else {}).items():
        if all(getattr(config, k, None) == v for k, v in values.items()):
            return name
    return None
