"""A capacity search's records: one ``Probe`` (a seeded trace at one rate and what came out of it) and the
``CapacityCurve`` of a candidate on a mix (every probe, and the answer).

Plain frozen data: the search that makes them is ``homepd.advise.campaign.capacity``; they live here, below
the store, because the store decodes them back from an advise run's recommendation
(``homepd.store.records``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TARGET_SHARE = 0.9


@dataclass(frozen=True)
class Probe:
    """One probe: a seeded trace of ``n_requests`` at ``rate_rps`` and what came out of it.  ``attainment``:
    share of requests meeting every SLO of their class; ``per_class``: that share per request class;
    ``misses``: failed requests by the target they missed first (``SLO.target_text``); ``duration_s``: the span
    it took (first arrival to last end, as the campaign measures it), what the time budget counts."""
    rate_rps: float
    n_requests: int
    attainment: float
    goodput_rps: float | None
    seed: int
    duration_s: float
    per_class: dict[str, float]
    misses: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CapacityCurve:
    """Attainment against rate for one candidate on one mix, and the answer.

    ``capacity_rps``: the highest passing rate below the lowest failing one (the median over repeats); None
    when no probe passed.  ``spread_rps``: how far it may be off: the range of the repeats' capacities, and
    at least the bracket it was left in (the lowest failing rate above it minus it); None when no probe
    failed above it (the capacity is then only a lower bound).  ``decided_by``: the SLO target that failed the
    most requests at the failing probes ("every gap <= 100 ms"), or why nothing decided."""
    candidate: str
    mix: str
    target_share: float
    resolution_rps: float
    probes: tuple[Probe, ...]
    capacity_rps: float | None
    spread_rps: float | None
    decided_by: str
