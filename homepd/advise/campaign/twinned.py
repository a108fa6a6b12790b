"""A candidate's capacity from its twin, checked against measurement on its own engine.

The order, for one candidate on one mix (``TwinSearch.run``): the twin simulates the candidate on ``N_SEEDS``
seeds of the mix's seeded trace (``homepd.twin.capacity``); then measured probes, each simulated as it ran and
compared (``TwinCheck``): the first at the capacity it found (where the answer is decided: the 90 % crossing), any
after it a little above, where the twin says the check's own short trace loses requests (``telling_rate``: at the
capacity a short check meets them all whether the twin is right or pessimistic); then the verdict
(``homepd.twin.check``).  Trusted, the answer is the twin's capacity and its interval; not trusted, the measured
probes' own curve, and the evidence says why.  The measured probes' records are the evidence's figures at the
capacity, as a measured search's are.

A mix the twin cannot take (a conversation's turns wait for the answers before them: closed-loop arrivals) is
searched by measurement only (``homepd.advise.campaign.probes``).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from homepd.advise.campaign.capacity import SearchSettings, curve_at_rates, probe_requests
from homepd.advise.campaign.probes import SearchOutcome, probe_of
from homepd.core.protocol import StepRecord
from homepd.stats import percentile
from homepd.core.terms import RequestClass
from homepd.measure.curve import CapacityCurve, Probe
from homepd.measure.metrics import SLO
from homepd.measure.replay import RunRecord
from homepd.measure.trace import Trace
from homepd.measure.trace.model import tagged
from homepd.twin.calibration import Calibration, step_speed
from homepd.twin.capacity import (FINE_STEPS_PER_OCTAVE, N_REQUESTS, N_SEEDS, TARGET_HALF_WIDTH, predict,
                                  predict_at, twin_capacity)
from homepd.twin.check import chance, met_band, verdict
from homepd.twin.records import TwinCapacity, TwinCheck
from homepd.twin.traces import TWIN_TAG, TraceRequests, of_trace

CHECK_SEED_BASE = 1000         # the checks' traces are seeds the twin did not simulate
MIN_CHECK_REQUESTS = 16        # a check probe's requests at least (one request: 6 points)
# what a check takes past its arrivals (the last requests' answers, the twin's prediction of the trace), as the
# budget reserves it: 1-5 s measured here (12 requests at 1.09 req/s took 14.5 s, at 0.37 req/s 31 s)
CHECK_TAIL_S = 5.0
TELLING_STEPS = (0.25, 0.5, 0.75, 1.0)   # octaves above the capacity where a check after the first may run
TWIN_SOURCE = "twin"


def twinnable(trace: Trace) -> bool:
    """Whether the twin takes this trace: open-loop arrivals, one turn per request."""
    return trace.concurrency is None and all(r.conversation is None for r in trace)


@dataclass
class TwinOutcome:
    """A twin-backed search: the curve the evidence ranks, the record at its capacity (for the figures), and the
    twin's own evidence."""
    outcome: SearchOutcome
    twin: TwinCapacity
    checks: tuple[TwinCheck, ...]


class TwinSearch:
    """One candidate on one mix.  ``make(rate, n, seed)``: the mix's seeded trace; ``tokenize(request)``: its
    prompt's token ids on the candidate's engine; ``run_probe(trace, rate, seed)``: a measured probe of that
    trace on the engine, to the end (a check is not stopped early), returning the trace as it ran (tagged apart
    from the other probes), its record and the engine's steps while it ran."""

    def __init__(self, config, cal: Calibration, mix: str, slo: SLO, speeds, search: SearchSettings,
                 make: Callable[[float, int, int], Trace], tokenize,
                 run_probe: Callable[[Trace, float, int], Awaitable[tuple[Trace, RunRecord, list[StepRecord]]]],
                 n_checks: int = 1,
                 n_seeds: int = N_SEEDS, n_requests: int = N_REQUESTS,
                 steps_per_octave: int = FINE_STEPS_PER_OCTAVE, check_requests: int = MIN_CHECK_REQUESTS,
                 pool: tuple[Calibration, ...] = (), max_seeds: int | None = None,
                 afford: Callable[[float], bool] = lambda seconds: True, check_span_s: float | None = None,
                 half_width: float = TARGET_HALF_WIDTH):
        self.config, self.cal, self.mix, self.slo, self.speeds = config, cal, mix, slo, speeds
        self.search, self.make, self.tokenize, self.run_probe = search, make, tokenize, run_probe
        self.n_checks, self.n_seeds, self.n_requests = n_checks, n_seeds, n_requests
        self.max_seeds = max(n_seeds, max_seeds or n_seeds)   # seeds added where the interval is wide
        # afford(seconds): whether the campaign's budget affords another check as long as the last (the first
        # check always runs), or the twin's seeds added where its interval is wide
        self.afford = afford
        self.steps_per_octave, self.check_requests = steps_per_octave, check_requests
        # a check's arrivals span at most this (None: no cap), its requests never fewer than a probe's
        # (``probe_requests``: one miss moves it by at most the attainment's resolution)
        self.check_span_s = check_span_s
        self.half_width = half_width   # seeds are added while the twin's interval is wider than this either way
        self.pool = pool      # earlier calibrations of the candidate on this box (``homepd.advise.campaign.pooled``)

    async def run(self, start_rps: float, seed: int = 0, on_simulated: Callable[[], None] = lambda: None
                  ) -> TwinOutcome:
        """The twin's capacity (``on_simulated`` called when it is found), then the checks at it."""
        requests = TraceRequests(lambda rate, n, s: tagged(self.make(rate, n, s), TWIN_TAG), self.n_requests,
                                 self.tokenize)
        await asyncio.to_thread(requests.prepare, range(self.max_seeds))
        twin = await asyncio.to_thread(twin_capacity, self.config, self.cal, requests, self.slo, self.speeds,
                                       start_rps, mix=self.mix, n_seeds=self.n_seeds, max_seeds=self.max_seeds,
                                       n_requests=self.n_requests,
                                       target_share=self.search.target_share,
                                       steps_per_octave=self.steps_per_octave, pool=self.pool, affords=self.afford,
                                       after_s=self.check_s, half_width=self.half_width)
        on_simulated()
        # why not the twin's lowest rate when nothing passed: its search walks down to 1/64 req/s, where a check of
        # 12 requests ran for 13 minutes of a 2-minute quick campaign; where the search started, the check still
        # asks what the twin says (that it fails there)
        rate = twin.capacity_rps or start_rps
        checks, probes, records = [], [], {}
        last_s = 0.0
        for i in range(self.n_checks):
            if i and not self.afford(last_s):
                break
            t0 = time.monotonic()
            check_seed = CHECK_SEED_BASE + seed * 10 + i
            # why the first at the capacity: its record is the evidence's figures there, which the rule reads (a
            # disaggregated candidate's TTFT and per-token shares); the next where a check can refuse either way
            at = rate if i == 0 or twin.capacity_rps is None else \
                await asyncio.to_thread(self.telling_rate, rate, check_seed)
            n = self.check_size(at)
            trace = self.make(at, n, check_seed)
            trace, record, steps = await self.run_probe(trace, at, check_seed)
            ids = [tuple(self.tokenize(r)) for r in trace]
            predicted = await asyncio.to_thread(predict, self.config, self.cal, of_trace(trace, ids), self.slo,
                                                self.speeds, at, pool=self.pool)
            probe = probe_of(record, at, check_seed, self.slo, self.speeds, n_planned=n)
            checks.append(check_of(record, probe, predicted, self.mix, step_speed(self.cal, steps)))
            probes.append(probe)
            records[at] = record
            last_s = time.monotonic() - t0
        trusted, _, _ = verdict(tuple(checks))
        if trusted and twin.capacity_rps is not None:
            curve = CapacityCurve(self.cal.candidate, self.mix, self.search.target_share, twin.resolution_rps,
                                  tuple(probes), twin.capacity_rps, None, twin.decided_by,
                                  interval_rps=twin.interval_rps, source=TWIN_SOURCE,
                                  attainment_at_half=twin.attainment_at_half)
        else:
            curve = curve_at_rates(self.cal.candidate, self.mix, probes, self.search.target_share)
        return TwinOutcome(SearchOutcome(curve, records.get(rate), records), twin, tuple(checks))

    def telling_rate(self, capacity_rps: float, check_seed: int) -> float:
        """Where a check after the first runs: the lowest rate of ``TELLING_STEPS`` above the capacity at which the
        twin's band for that check's own trace (``met_band``) leaves out every request met, so that the check can
        refuse a twin that is pessimistic as well as one that is optimistic; the capacity where none does.
        # why: at the capacity a short check meets nearly every request whatever the twin's error (three quick runs'
        twins said 0.55, 0.90 and 0.81 req/s, and each one's check met 12 of 12 inside its band)"""
        traces = []
        for k in TELLING_STEPS:
            rate = capacity_rps * 2 ** k
            trace = self.make(rate, self.check_size(rate), check_seed)
            traces.append((rate, of_trace(trace, [tuple(self.tokenize(r)) for r in trace])))
        predictions = predict_at(self.config, self.cal, traces, self.slo, self.speeds, pool=self.pool)
        for (rate, requests), p in zip(traces, predictions):
            n = len(requests)
            if met_band([([chance(c, p.n_draws) for c in p.chances], p.counts)])[1] < n:
                return rate
        return capacity_rps

    def check_size(self, rate_rps: float) -> int:
        """A check's requests at ``rate_rps``: ``check_requests``, fewer where their arrivals would span more than
        ``check_span_s``, never fewer than a probe's."""
        n = self.check_requests
        if self.check_span_s is not None:
            n = min(n, math.ceil(rate_rps * self.check_span_s - 1e-9))
        return max(n, probe_requests(rate_rps, self.search))

    def check_s(self, rate_rps: float | None) -> float:
        """The wall time of the first check at ``rate_rps`` (which always runs), as the budget reserves it."""
        if not rate_rps:
            return 0.0
        return (self.check_size(rate_rps) - 1) / rate_rps + CHECK_TAIL_S


def check_of(record: RunRecord, probe: Probe, predicted, mix: str = "", speed: float | None = None) -> TwinCheck:
    """A measured probe's figures (its attainment as the search counts it: ``probe_of``) beside the twin's
    prediction of that very trace; ``speed``: its steps' time over their calibrated time (``step_speed``)."""
    requests = list(record.requests)
    ttft = [lc.ttft_s * 1e3 for lc in requests if lc.ttft_s is not None]
    gaps = [max(lc.itl_s) * 1e3 for lc in requests
            if lc.request_class is RequestClass.INTERACTIVE and len(lc.token_times_s) > 1]
    return TwinCheck(rate_rps=probe.rate_rps, seed=probe.seed, n_requests=probe.n_requests,
                     measured_attainment=probe.attainment, measured_ttft_ms_p50=percentile(ttft, 50),
                     measured_ttft_ms_p90=percentile(ttft, 90), measured_gap_ms_p90=percentile(gaps, 90),
                     predicted_attainment=predicted.attainment, predicted_ttft_ms_p50=predicted.ttft_ms_p50,
                     predicted_ttft_ms_p90=predicted.ttft_ms_p90, predicted_gap_ms_p90=predicted.gap_ms_p90,
                     mix=mix, predicted_chances=predicted.chances, n_draws=predicted.n_draws, step_speed=speed,
                     predicted_counts=predicted.counts)
