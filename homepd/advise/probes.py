"""One capacity search on a running engine: the probes of ``homepd.advise.capacity.CapacitySearch``, each a
seeded trace replayed at its rate, and what each probe's run record says to the search."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from homepd.advise.capacity import CapacityCurve, CapacitySearch, Probe, SearchSettings, probe_requests
from homepd.measure.metrics import SLO
from homepd.measure.replay import RunRecord


def probe_of(record: RunRecord, rate_rps: float, seed: int, slo: SLO) -> Probe:
    """What a probe's run record tells the search: attainment (every SLO of each request's class), per class,
    goodput, and the failed requests by the target they missed first."""
    requests = record.requests
    n = len(requests)
    per_class: dict[str, list[bool]] = {}
    misses: dict[str, int] = {}
    for lc in requests:
        missed = slo.miss(lc)
        per_class.setdefault(str(lc.request_class), []).append(missed is None)
        if missed is not None:
            what = slo.target_text(missed)
            misses[what] = misses.get(what, 0) + 1
    met = sum(ok for oks in per_class.values() for ok in oks)
    duration_s = n / rate_rps if rate_rps > 0 else 0.0
    return Probe(rate_rps=rate_rps, n_requests=n, attainment=met / n if n else 0.0,
                 goodput_rps=record.summary.goodput_per_s, seed=seed, duration_s=duration_s,
                 per_class={k: sum(v) / len(v) for k, v in per_class.items()}, misses=misses)


@dataclass
class SearchOutcome:
    """A finished search: its curve, and the run record at the capacity (the lowest-rate probe's when none
    passed) — the figures the evidence table shows."""
    curve: CapacityCurve
    record_at_capacity: RunRecord | None


async def search_capacity(candidate: str, mix: str, start_rps: float, settings: SearchSettings, seed: int,
                          slo: SLO, run_probe: Callable[[float, int, int], Awaitable[RunRecord]]) -> SearchOutcome:
    """Run one search: ``run_probe(rate_rps, n_requests, seed)`` replays a probe and returns its record."""
    search = CapacitySearch(start_rps, settings)
    records: dict[float, RunRecord] = {}
    while (rate := search.next_rate()) is not None:
        record = await run_probe(rate, probe_requests(rate, settings), seed)
        records[rate] = record
        search.record(probe_of(record, rate, seed, slo))
    curve = search.curve(candidate, mix)
    at = curve.capacity_rps if curve.capacity_rps is not None else min(records, default=None)
    return SearchOutcome(curve, records.get(at) if at is not None else None)
