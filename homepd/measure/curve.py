"""A capacity search's records: one ``Probe`` (a seeded trace at one rate and what came out of it) and the
``CapacityCurve`` of a candidate on a mix (every probe, and the answer); and the rule that a probe's box kept
up (``drain_allowance_s``), which the measured search and the twin count alike.

Plain frozen data: the search that makes them is ``homepd.advise.campaign.capacity``; they live here, below
the store, because the store decodes them back from an advise run's recommendation
(``homepd.store.records``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from homepd.measure.metrics import SLO

DEFAULT_TARGET_SHARE = 0.9
KEPT_UP = "the box keeps up (done within the drain allowance of the last arrival)"


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
    most requests at the failing probes ("every gap <= 100 ms"), or why nothing decided.

    ``source``: "measured" (a search of probes) or "twin" (the candidate's twin, checked against the probes it
    holds: ``homepd.twin``); a twin's curve states its ``interval_rps`` (where the capacity lies, both sides)."""
    candidate: str
    mix: str
    target_share: float
    resolution_rps: float
    probes: tuple[Probe, ...]
    capacity_rps: float | None
    spread_rps: float | None
    decided_by: str
    interval_rps: tuple[float, float] | None = None
    source: str = "measured"
    attainment_at_half: float | None = None     # a twin's, at half its capacity (``TwinCapacity.noise_bound``)


def drain_allowance_s(requests, slo: SLO, speeds: tuple[float | None, float | None]) -> float | None:
    """How long after a probe's last arrival its last request may finish at a rate the box sustains: the
    interactive TTFT budget (a request arriving last may wait that long) plus the longest request's service
    time alone at the calibrated speeds (``speeds``: prefill tok/s, decode step ms).  None without speeds.

    why: the background class may wait ``background_ttft_ms`` (2 minutes), longer than any probe, so above the
    capacity its backlog would grow through a probe unseen; this is the background's throughput target."""
    prefill_tok_s, step_ms = speeds
    if not requests or not prefill_tok_s or not step_ms:
        return None
    longest = max(lc.n_prompt_tokens / prefill_tok_s + len(lc.token_times_s) * step_ms / 1e3 for lc in requests)
    return slo.ttft_ms / 1e3 + longest
