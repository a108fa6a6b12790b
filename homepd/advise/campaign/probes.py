"""One capacity search on a running engine: the probes of ``homepd.advise.campaign.capacity.CapacitySearch``, each a
seeded trace replayed at its rate, and what each probe's run record says to the search."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from homepd.advise.campaign.capacity import CapacityCurve, CapacitySearch, Probe, SearchSettings, probe_requests
from homepd.core.lifecycle import RequestState
from homepd.measure.curve import KEPT_UP, drain_allowance_s
from homepd.measure.metrics import SLO
from homepd.measure.replay import RunRecord


def decided_failing(n_planned: int, slo: SLO, target_share: float):
    """A ``replay`` stop rule for a probe of ``n_planned`` requests: True once more of them have missed than
    the target share allows, counting the ended ones that missed a target of their class and the running
    interactive ones already past the TTFT budget without a first token or with a gap over the per-token
    target (every-gap SLO).  Then the probe's outcome cannot change: the rest is time spent on nothing."""
    allowed = n_planned - math.ceil(target_share * n_planned - 1e-9)

    def stop(ended, running) -> bool:
        now = time.monotonic()
        misses = sum(1 for lc in ended if slo.miss(lc) is not None) \
            + sum(1 for lc in running if slo.is_doomed(lc, now))
        return misses > allowed

    return stop


def probe_of(record: RunRecord, rate_rps: float, seed: int, slo: SLO,
             speeds: tuple[float | None, float | None] = (None, None), n_planned: int | None = None) -> Probe:
    """What a probe's run record tells the search: attainment (every SLO of each request's class, and the box
    keeping up: ``drain_allowance_s``), per class, goodput, and the failed requests by the target they missed
    first.  ``n_planned``: the probe's requests, those never sent (stopped early: ``decided_failing``) counting
as not met (and not as any target's miss: the ones that decided it are named)."""
    requests = record.requests
    n = max(len(requests), n_planned or 0)
    per_class: dict[str, list[bool]] = {}
    misses: dict[str, int] = {}
    allowance = drain_allowance_s(requests, slo, speeds)
    deadline = max(lc.arrived_s for lc in requests) + allowance if allowance is not None and requests else None
    for lc in requests:
        if lc.state is RequestState.CANCELLED:  # stopped with the probe (``decided_failing``): not met, no target's
            per_class.setdefault(str(lc.request_class), []).append(False)
            continue
        missed = slo.miss(lc)
        what = slo.target_text(missed) if missed is not None else None
        if what is None and deadline is not None and lc.ended_s is not None and lc.ended_s > deadline:
            what = KEPT_UP
        per_class.setdefault(str(lc.request_class), []).append(what is None)
        if what is not None:
            misses[what] = misses.get(what, 0) + 1
    met = sum(ok for oks in per_class.values() for ok in oks)
    # what the search's time budget counts: the probe as it ran (arrivals and drain, think times included)
    ends = [lc.ended_s for lc in requests if lc.ended_s is not None]
    duration_s = max(ends) - min(lc.arrived_s for lc in requests) if ends else (n / rate_rps if rate_rps > 0 else 0.0)
    return Probe(rate_rps=rate_rps, n_requests=n, attainment=met / n if n else 0.0,
                 goodput_rps=record.summary.goodput_per_s, seed=seed, duration_s=duration_s,
                 per_class={k: sum(v) / len(v) for k, v in per_class.items()}, misses=misses)


@dataclass
class SearchOutcome:
    """A finished search: its curve, and the run record at the capacity (the lowest-rate probe's when none
    passed) — the figures the evidence table shows."""
    curve: CapacityCurve
    record_at_capacity: RunRecord | None
    records: dict[float, RunRecord] = field(default_factory=dict)  # rate -> record, every probe (and prior)


async def search_capacity(candidate: str, mix: str, start_rps: float, settings: SearchSettings, seed: int,
                          slo: SLO, run_probe: Callable[[float, int, int], Awaitable[RunRecord]], *,
                          speeds: tuple[float | None, float | None] = (None, None), prior: tuple[Probe, ...] = (),
                          prior_records: dict[float, RunRecord] | None = None) -> SearchOutcome:
    """Run one search: ``run_probe(rate_rps, n_requests, seed)`` replays a probe and returns its record.
    ``prior``/``prior_records``: a coarser search's probes and records to refine from (``CapacitySearch``)."""
    search = CapacitySearch(start_rps, settings, prior=prior)
    records: dict[float, RunRecord] = dict(prior_records or {})
    while (rate := search.next_rate()) is not None:
        record = await run_probe(rate, probe_requests(rate, settings), seed)
        records[rate] = record
        search.record(probe_of(record, rate, seed, slo, speeds, n_planned=probe_requests(rate, settings)))
    curve = search.curve(candidate, mix)
    at = curve.capacity_rps if curve.capacity_rps is not None else min(records, default=None)
    return SearchOutcome(curve, _record_at(records, at), records)


def _record_at(records: dict[float, RunRecord], rate: float | None) -> RunRecord | None:
    if rate is None:
        return None
    near = [r for r in records if abs(r - rate) <= 1e-9 * max(1.0, rate)]  # the grid rate, computed twice
    return records[near[0]] if near else None
