"""The twin's records: what the evidence keeps of it, below the store (which decodes them back).

``TwinCapacity``: a candidate's capacity from its twin on one mix, with its interval and curve.  ``TwinCheck``: one
measured probe beside the twin's prediction of that very probe.  ``TwinEvidence``: a candidate's calibration, its
twin's capacities and checks, and whether the twin is trusted for it (``homepd.twin.check``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from homepd.config import EngineConfig
from homepd.twin.calibration import Calibration

CONFIDENCE = 0.9
NOISE_MARGIN = 0.05     # attainment at half the capacity under target + this: the capacity is noise-bound


def is_noise_bound(attainment_at_half: float | None, target_share: float) -> bool:
    """The rule of ``TwinCapacity.noise_bound``, for a capacity as a curve carries it too."""
    return attainment_at_half is not None and attainment_at_half < target_share + NOISE_MARGIN


CALIBRATION_MIX = "calibration"   # a stored calibration burst's mix (a closed loop, not a probe of a traffic mix)


@dataclass(frozen=True)
class TwinPoint:
    """The twin at one rate: attainment pooled over the seeds run there (and each seed's)."""
    rate_rps: float
    attainment: float
    by_seed: tuple[float, ...]
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    gap_ms_p90: float | None


@dataclass(frozen=True)
class TwinCapacity:
    """A candidate's capacity from its twin on one mix: the median of ``n_seeds`` seeds' capacities, its
    ``interval_rps`` (the order-statistic interval of the median, ``confidence``), the seeds' own capacities, and
    the attainment curve.  ``sim_s``: the simulations' time (summed over processes); ``virtual_s``: the time they
    simulated."""
    candidate: str
    mix: str
    target_share: float
    capacity_rps: float | None
    interval_rps: tuple[float, float] | None
    # each seed's (None: nothing passed); a seed shown to lie wholly above or below the median's interval is not
    # searched further, and its entry is the highest rate it passed (homepd.twin.capacity._seed_capacities)
    seed_capacities: tuple[float | None, ...]
    points: tuple[TwinPoint, ...]
    n_seeds: int
    n_requests: int
    resolution_rps: float
    sim_s: float
    virtual_s: float
    wall_s: float
    decided_by: str
    confidence: float = CONFIDENCE
    # the attainment pooled over a few seeds at half the capacity (None: not run, or a run stored before it)
    attainment_at_half: float | None = None
    n_calibrations: int = 1           # the calibrations its seeds ran on: this run's and earlier ones (pooled)

    @property
    def speedup(self) -> float:
        """Simulated time over the time it took to simulate (per process)."""
        return self.virtual_s / self.sim_s if self.sim_s > 0 else math.inf

    @property
    def noise_bound(self) -> bool:
        """At half its capacity the candidate still misses nearly as much as the target allows: its misses are the
        box's step-time noise against a budget, more than load, so its capacity is ill-conditioned (a flat curve
        crosses the target share wherever the calibration's tail puts it)."""
        return is_noise_bound(self.attainment_at_half, self.target_share)

    @property
    def half_width(self) -> float | None:
        """The interval's half-width as a share of the capacity."""
        if self.capacity_rps is None or self.interval_rps is None:
            return None
        return (self.interval_rps[1] - self.interval_rps[0]) / 2 / self.capacity_rps


@dataclass(frozen=True)
class TwinPrediction:
    """The twin's prediction of one trace: means over ``n_draws`` draws of the box's noise."""
    attainment: float
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    gap_ms_p90: float | None
    n_draws: int
    chances: tuple[float, ...] = ()   # each request's share of the draws in which it met its SLO, in trace order
    counts: tuple[int, ...] = ()      # each draw's count of requests that met it


@dataclass(frozen=True)
class TwinCheck:
    """One measured probe (``rate_rps``, ``seed``) beside the twin's prediction of that very trace."""
    rate_rps: float
    seed: int
    n_requests: int
    measured_attainment: float
    measured_ttft_ms_p50: float | None
    measured_ttft_ms_p90: float | None
    measured_gap_ms_p90: float | None
    predicted_attainment: float
    predicted_ttft_ms_p50: float | None
    predicted_ttft_ms_p90: float | None
    predicted_gap_ms_p90: float | None
    mix: str = ""                     # the trace's mix ("": a run stored before checks named it)
    # the twin's chance for each request of meeting its SLO (its share of ``n_draws`` draws), in the trace's order;
    # (): a check stored before they were kept (``homepd.twin.check`` then judges by the error alone)
    predicted_chances: tuple[float, ...] = ()
    n_draws: int = 0
    # each draw's count of requests met (a slow draw slows them all: the counts spread wider than independent
    # chances say where the trace loses requests); (): a check stored before they were kept
    predicted_counts: tuple[int, ...] = ()
    # the probe's steps' measured time over the calibration's price for them (``calibration.step_speed``, a
    # median): 1.3, the box ran 30 % slower than during its burst; None: not measured (a run stored before)
    step_speed: float | None = None

    @property
    def measured_met(self) -> int:
        return round(self.measured_attainment * self.n_requests)

    @property
    def attainment_error_points(self) -> float:
        """|predicted - measured| attainment, in points (percent)."""
        return abs(self.predicted_attainment - self.measured_attainment) * 100

    def relative_error(self, figure: str) -> float | None:
        """|predicted - measured| / measured of ``figure`` (``ttft_ms_p50``, ``ttft_ms_p90``, ``gap_ms_p90``)."""
        measured, predicted = getattr(self, f"measured_{figure}"), getattr(self, f"predicted_{figure}")
        if measured is None or predicted is None or measured <= 0:
            return None
        return abs(predicted - measured) / measured


@dataclass(frozen=True)
class TwinEvidence:
    """A candidate's twin: its calibration, its capacity per mix, the measured checks, and the verdict on them
    (``trusted``, with ``why``; ``attainment_error_points``: the median over the checks)."""
    candidate: str
    calibration: Calibration
    capacities: tuple[TwinCapacity, ...] = ()
    checks: tuple[TwinCheck, ...] = ()
    trusted: bool = False
    why: str = ""
    attainment_error_points: float | None = None
    config: EngineConfig | None = None     # the candidate's engine configuration (what-if and live advice replay it)
    # earlier runs whose calibration of the candidate, on the same box and settings, the twin pooled with this one
    pooled_runs: tuple[int, ...] = ()

    def capacity(self, mix: str) -> TwinCapacity | None:
        return next((c for c in self.capacities if c.mix == mix), None)
