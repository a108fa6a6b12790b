"""Live advice on the twin: today's traffic replayed through each calibrated candidate's twin.

Instead of matching the recorded window to the nearest measured mix, the window's own requests (their arrivals,
prompts and outputs, from the service's traffic table) are simulated on every candidate the latest advise run
calibrated (``TwinEvidence``), a few draws of the box's noise each: each candidate's projected attainment on
today's traffic.  The verdict (``twin_verdict``): switch when the running candidate's projected attainment is
under the target share and another's is at it (or ``SWITCH_MARGIN`` above the running one's), at-capacity when
none reaches it, keep otherwise.  Each figure is the twin's, checked on the run it came from (``trusted``).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from homepd.measure.curve import DEFAULT_TARGET_SHARE
from homepd.measure.metrics import SLO
from homepd.twin.capacity import run_figures
from homepd.twin.records import TwinEvidence
from homepd.twin.sim import SimRequest

REPLAY_DRAWS = 3
SWITCH_MARGIN = 0.1      # projected attainment a switch must gain over the running candidate (10 points)


@dataclass(frozen=True)
class Replay:
    """One candidate's projection on the window: its mean attainment over ``n_draws`` draws of the noise."""
    candidate: str
    attainment: float
    ttft_ms_p50: float | None
    gap_ms_p90: float | None
    n_requests: int
    n_draws: int
    trusted: bool

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def replay_window(requests: list[SimRequest], twins: list[TwinEvidence], slo: SLO, rate_rps: float,
                  draws: int = REPLAY_DRAWS) -> list[Replay]:
    """Each calibrated candidate's projection on ``requests`` (the window's, tokenized)."""
    out = []
    for twin in twins:
        if twin.config is None or not requests:
            continue
        figs = [run_figures(twin.config, twin.calibration, requests, slo, (None, None), rate_rps, seed)
                for seed in range(draws)]
        ttft = [statistics.median(f.ttft_ms) for f in figs if f.ttft_ms]
        gaps = [sorted(f.gap_ms)[int(0.9 * len(f.gap_ms))] for f in figs if f.gap_ms]
        out.append(Replay(twin.candidate, statistics.mean(f.attainment for f in figs),
                          statistics.mean(ttft) if ttft else None, statistics.mean(gaps) if gaps else None,
                          len(requests), draws, twin.trusted))
    return out


def twin_verdict(replays: list[Replay], running: str | None,
                 target_share: float = DEFAULT_TARGET_SHARE) -> tuple[str, str | None, str]:
    """(kind, advised candidate, reason) from the replays: ``switch``, ``at-capacity`` or ``keep`` (the values of
    ``homepd.advise.live.advice.AdviceKind``)."""
    if not replays:
        return "no-evidence", running, "no calibrated candidate to replay the traffic on"
    mine = next((r for r in replays if r.candidate == running), None)
    best = max(replays, key=lambda r: (r.attainment, r.candidate == running))
    table = ", ".join(f"{r.candidate} {r.attainment:.0%}" + ("" if r.trusted else " (twin not trusted)")
                      for r in sorted(replays, key=lambda r: -r.attainment))
    projected = f"today's traffic replayed in each candidate's twin ({replays[0].n_requests} requests): {table}"
    if mine is None:
        return "unmeasured", running, f"the running configuration ({running or 'unknown'}) has no twin; {projected}"
    if best is not mine and best.trusted and best.attainment >= max(target_share, mine.attainment + SWITCH_MARGIN) \
            - 1e-12:
        return "switch", best.candidate, (f"{best.candidate} would serve it better: {projected}")
    if best.attainment < target_share:
        return "at-capacity", running, f"no candidate keeps {target_share:.0%} within the SLO: {projected}"
    return "keep", running, f"keep {running}: {projected}"
