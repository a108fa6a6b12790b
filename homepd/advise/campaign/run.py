"""The advise campaign: every feasible architecture's capacity on identical traces, stored as evidence, then
the rule.

probe -> placement plan -> candidates (colocated unchunked and chunked, the chunk the calibration worker's own
step-time model gives for the ITL target, as its step policy would budget it, the adaptive chunk, disaggregated
with every prompt handed off and with learned routing, replicas; infeasible ones with their reason) -> a
calibration burst on the first candidate (the box's prefill and decode speeds: where every search starts) -> for each candidate, one engine, and per mix (and repeat) a capacity
search (``homepd.advise.campaign.capacity``: probes at rates on one grid, each a seeded trace, the same trace for every
candidate at the same rate) -> which runs did not exercise their architecture (not ranked) -> a recovery
scenario per architecture (a worker killed mid-run) -> ``recommend``
-> store.  Never changes the serving configuration: ``homepd advise apply`` is a separate step.

**Time.**  A campaign has a wall-clock budget (``AdviseSettings.wall_budget_s``: quick 105 s, so that the
command ends within 2 minutes on a 2-core box; full 30 minutes, ``--budget``), shared out between the searches
still to run: each search's probes get ``PROBE_SHARE`` of its share (the rest is engine starts and warm-ups),
and a search stops when its share is spent, its answer saying how coarse it is (its first probe always runs).
A faster box gets finer answers in the same time.

**Quick:** the mixed trace (the full campaign's, so that their answers compare), one repeat, the best scheduler of colocated and of disaggregated serving only (the
last candidate their topologies list: colocated-adaptive, disaggregated-routed), on a grid of 2 steps per octave (a
factor 1.41).  **Full:** every candidate on every mix on that coarse grid first (the screen), then, per mix,
each architecture's best is refined on the grid of 4 steps per octave (1.19) from the screen's bracket, and
on the mixed trace (the answer's) repeated on another seed.  The quick grid is a subset of the full one, so their answers can only differ within
the quick answer's interval (``answer_interval``).  Every search after the first on a mix starts at the
capacity the earlier candidates measured there (neighbours are usually close: one probe then brackets).
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from homepd.advise.campaign.budgets import FULL_WALL_BUDGET_S, QUICK_WALL_BUDGET_S
from homepd.advise.campaign.capacity import (CapacityCurve, SearchSettings, answer_interval, combine, probe_span_s,
                                             start_rate_rps)
from homepd.advise.campaign.probes import decided_failing, search_capacity
from homepd.advise.campaign.exercised import not_exercised
from homepd.advise.campaign.pooled import MAX_EARLIER, earlier_calibrations, recent_runs
from homepd.advise.campaign.recommend import Candidate, Evidence, Measurement, Recommendation, recommend
from homepd.advise.campaign.twinned import MIN_CHECK_REQUESTS, TWIN_SOURCE, TwinSearch, twinnable
from homepd.config import EngineConfig
from homepd.core.modes import Mode, Role
from homepd.core.records import to_plain
from homepd.core.protocol import StepRecord
from homepd.core.sampling import SamplingParams
from homepd.core.terms import StepEstimate
from homepd.core.steppolicy import StepPolicy
from homepd.engine.controller import Engine
from homepd.errors import ConfigError
from homepd.engine.topology import topology_for
from homepd.engine.topology.colocated import chunk_candidate
from homepd.hw.probe import probe, to_dict
from homepd.launch import placement_plan, prepare
from homepd.measure.metrics import SLO, SLOTarget
from homepd.measure.replay import RunRecord, run_trace
from homepd.measure.trace import make_trace
from homepd.measure.trace.conversations import CHAT_TURNS
from homepd.measure.trace.model import estimate_tokens, tagged
from homepd.store import rows
from homepd.store.records import Run, decode_run
from homepd.twin.burst import burst_trace, calibrate
from homepd.twin.calibration import Calibration, quieter
from homepd.twin.capacity import FINE_STEPS_PER_OCTAVE, MORE_SEEDS, N_REQUESTS, N_SEEDS, TARGET_HALF_WIDTH
from homepd.twin.check import verdict
from homepd.twin.records import CALIBRATION_MIX, TwinEvidence

CALIBRATION_CHUNK = 256
# why: below this a long prompt needs hundreds of steps; when the model says even an empty step misses the
# target, the smallest chunk still helps more than an unbounded one, and the evidence shows the cost
MIN_PREDICTED_CHUNK = 16
MAX_PREDICTED_CHUNK = 2048
CALIBRATION_REQUESTS = 4          # the calibration burst: the mixed trace's first requests, all at once
# why a coarser twin grid and shorter checks quick: the 2 minutes (the 16-step grid and 16-request checks took
# 140-160 s on 2 cores); 8 steps an octave is 9 % a step, and 20 seeds' median still falls between grid points
QUICK_STEPS_PER_OCTAVE = 8
QUICK_CHECK_REQUESTS = 12
# why a span: a quick check of 12 requests at a disaggregated twin's 0.37 req/s ran 31 s, the campaign's longest
# stage (and at 0.62 req/s 24 s, when a slow hour's run ended at 126 s); its arrivals within 15 s it is 10
# requests below 0.74 req/s (a probe's fewest), 12 from 0.8 req/s up
QUICK_CHECK_SPAN_S = 15.0
# why 15 % quick: what the quick answer promises (each candidate's interval within +-15 %); seeds added at 12 %
# took a disaggregated twin from 20 to 30 seeds (22 to 34 s) for an interval of 13 %
QUICK_HALF_WIDTH = 0.15
BURST_SEED = 77                   # the twin's calibration burst draws its requests from this seed
RECOVERY_REQUESTS = 8
# probe_s is set from the SLO's TTFT budget and the grid (``probe_span_s``) when the campaign starts
# why time_budget_s 90: the wall budget's share is what bounds a search (the quick campaign's last one gets
# all that is left)
# why shrink_steps 1: a probe one step below (x1.41) costs 1.41x its failing neighbour, two steps 2x; with a
# share of about 30 s the screen affords the first, and a passing rate is what ranks a candidate
SCREEN_SEARCH = SearchSettings(steps_per_octave=2, grow_steps=2, shrink_steps=1, max_probes=3, time_budget_s=90.0,
                               probe_s=10.0, max_requests=48)
QUICK_SEARCH = SCREEN_SEARCH
FULL_SEARCH = SearchSettings(steps_per_octave=4, grow_steps=2, max_probes=4, time_budget_s=75.0, probe_s=22.0,
                             max_requests=96)
# why: a search's probes (arrivals and drain, as measured) get this share of its time; engine starts and
# warm-ups take the rest (about 3 s of a 30 s search here)
PROBE_SHARE = 0.85
SCREEN_SHARE = 0.5            # full: the screen's part of the budget; the refinement gets the rest
RECOVERY_RESERVE_S = 20.0     # per architecture's recovery scenario
PROGRESS_TICK_S = 1.0         # the progress line counts its ETA down this often between its steps
# why: batching lets a box serve more than one request at a time (here the adaptive chunk passed at twice the
# serial rate), and probing above the edge is cheaper than below it (a probe's length is its requests over the
# rate, and a failing one stops once decided)
START_UTILISATION = 2.0
# why: on 2 cores a capacity near 0.5-1 req/s makes a meaningful probe 10-20 s long, so 2 minutes hold about
# five probes: two or three each for the product's question, colocated (chunked) or disaggregated; the full
# campaign adds replicas and the fixed chunks
QUICK_MODES = tuple(m for m in Mode if m.traits.quick)


@dataclass(frozen=True)
class AdviseSettings:
    """How big the campaign is; ``quick`` sizes it for about 2 minutes on a 2-core box.  ``slo`` None: the
    engine's class budgets (``EngineConfig.class_budgets``) are the SLO."""
    quick: bool = False
    mixes: tuple[str, ...] = ("short", "long", "mixed", "chat")
    repeats: int = 2                   # of each refined search on ``repeat_mixes`` (full); the rest run once
    repeat_mixes: tuple[str, ...] = ("mixed",)  # the mix the answer is for (and a given traffic's: ``mixes``)
    chunks: tuple[int | None, ...] = (None, CALIBRATION_CHUNK)
    search: SearchSettings = SCREEN_SEARCH      # every candidate on every mix (coarse)
    refine: SearchSettings | None = FULL_SEARCH  # each architecture's best per mix (fine), None: no refinement
    wall_budget_s: float | None = FULL_WALL_BUDGET_S
    max_tokens: int = 32
    long_tokens: int = 400
    recovery: bool = True
    seed: int = 0
    slo: SLO | None = None
    only: tuple[str, ...] | None = None  # measure just these candidates (``--candidates``); None: every one
    # the twin (homepd.twin): each candidate calibrated by a burst, its capacity simulated on many seeds and checked
    # by ``twin_checks`` measured probes at it; False: measured searches only (the campaign before the twin)
    twin: bool = True
    twin_checks: int = 2
    burst_per_sequence: int = 3                # calibration burst: requests per sequence id of each entry worker
    twin_steps_per_octave: int = FINE_STEPS_PER_OCTAVE   # the twin's rate grid (16: 4.4 % a step)
    check_requests: int = MIN_CHECK_REQUESTS   # a check probe's requests at least
    check_span_s: float | None = None           # ... fewer where their arrivals would span more (a probe's at least)
    twin_seeds: int = N_SEEDS                  # seeds the twin runs each rate on (fewer: faster, a wider interval)
    twin_requests: int = N_REQUESTS            # requests a simulated run (fewer: faster, a coarser attainment)
    # seeds the twin may add where its interval is wider than TARGET_HALF_WIDTH (homepd.twin.capacity); a campaign
    # asked for fewer than N_SEEDS asked for speed, and gets none
    twin_more_seeds: int = MORE_SEEDS
    twin_half_width: float = TARGET_HALF_WIDTH   # ... the interval's half-width, as a share of the capacity

    @property
    def twin_max_seeds(self) -> int:
        return self.twin_seeds + (self.twin_more_seeds if self.twin_seeds >= N_SEEDS else 0)
    # earlier calibrations of a candidate on this box its twin pools with the run's own (homepd.advise.campaign.pooled)
    twin_pool: int = MAX_EARLIER

    @classmethod
    def quick_settings(cls, **kw) -> "AdviseSettings":
        base = dict(quick=True, mixes=("mixed",), repeats=1, chunks=(None, CALIBRATION_CHUNK),
                    search=QUICK_SEARCH, refine=None, wall_budget_s=QUICK_WALL_BUDGET_S, recovery=False,
                    twin_checks=1, burst_per_sequence=2, twin_steps_per_octave=QUICK_STEPS_PER_OCTAVE,
                    check_requests=QUICK_CHECK_REQUESTS, check_span_s=QUICK_CHECK_SPAN_S,
                    twin_half_width=QUICK_HALF_WIDTH)
        base.update(kw)
        return cls(**base)


@dataclass(frozen=True)
class Progress:
    """Where the campaign is: runs done of the total, the current step (and the candidate it is for, None for the
    campaign's own), elapsed and estimated time left."""
    done: int
    total: int
    current: str
    elapsed_s: float
    eta_s: float | None
    candidate: str | None = None


@dataclass
class AdviseResult:
    run_id: int | None
    candidates: list[Candidate]
    records: dict[tuple[str, str, int], RunRecord]       # (candidate, mix, repeat) -> record
    recovery: dict[str, RunRecord]                       # architecture -> the killed-worker run
    recommendation: Recommendation
    settings: AdviseSettings
    box: dict
    predicted_chunk: int | None
    wall_s: float
    capacity: dict[tuple[str, str], CapacityCurve] = field(default_factory=dict)  # (candidate, mix) -> curve
    speeds: tuple[float | None, float | None] = (None, None)  # calibration: prefill tok/s, decode step ms
    base: EngineConfig | None = None                     # the campaign's base configuration
    not_exercised: dict[tuple[str, str], str] = field(default_factory=dict)  # (candidate, mix) -> why
    twins: dict[str, TwinEvidence] = field(default_factory=dict)  # candidate -> its twin and its checks

    @functools.cached_property
    def run(self) -> Run:
        """This result as the store's typed ``Run``, written by the store's row functions and read back by its
        decoder, so that the report, the pictures and the app read a live result exactly as a stored run.
        Its probes are the records at each capacity (the live result keeps no other), under the plain mix."""
        measured = [{"candidate": cand, "mix": mix, "repeat": repeat, **rows.result_row(record, 0),
                     "record": {**record.to_dict(), "requests": [rows.lifecycle_dict(lc) for lc in record.requests]}}
                    for (cand, mix, repeat), record in self.records.items()]
        infeasible = [{"candidate": c.name, "status": "infeasible", "reason": c.reason, "mix": None}
                      for c in self.candidates if not c.feasible]
        return decode_run({
            "id": self.run_id, "kind": "advise", "status": "complete", "hardware": self.box,
            "config": {"base": to_plain(self.base), "settings": to_plain(self.settings)},
            "results": infeasible + measured,
            "recommendations": [{"headline": _headline(self.recommendation), "data": advice_data(
                self.recommendation, self.capacity, self.candidates, self.not_exercised, self.twins)}]})


def advice_data(rec: Recommendation, capacity: dict[tuple[str, str], CapacityCurve], candidates: list[Candidate],
                not_exercised: dict[tuple[str, str], str], twins: dict[str, TwinEvidence] | None = None) -> dict:
    """A recommendation as the store keeps it (``homepd.store.records.RunAdvice``): with every candidate's
    configuration (`homepd advise apply --candidate` may choose any of them), the capacity curves, and each
    candidate's twin (its calibration, capacities and checks: what-if and live advice replay it)."""
    return {**to_plain(rec), "capacity": [to_plain(c) for c in capacity.values()],
            "candidates": to_plain(candidates),
            "not_exercised": [{"candidate": c, "mix": m, "reason": why} for (c, m), why in not_exercised.items()],
            "twins": [to_plain(t) for t in (twins or {}).values()]}


def candidate_list(base: EngineConfig, plan, settings: AdviseSettings) -> list[Candidate]:
    """The configurations to measure on this box; infeasible ones carry the plan's reason.  Quick: the best
    scheduler (the last its topology lists) of colocated and of disaggregated serving (``QUICK_MODES``).  With ``settings.only``, just those (a name
    that is not a candidate here is a ConfigError listing them)."""
    per_mode = {mode: topology_for(mode).advise_candidates(base, plan, settings.chunks) for mode in Mode}
    every = [c for listed in per_mode.values() for c in listed]
    if settings.only is None:
        return [per_mode[m][-1] for m in QUICK_MODES if per_mode[m]] if settings.quick else every
    unknown = [n for n in settings.only if n not in {c.name for c in every}]
    if unknown:
        raise ConfigError(f"--candidates: {', '.join(unknown)} not a candidate here; the candidates are "
                          f"{', '.join(c.name for c in every)}")
    return [c for c in every if c.name in settings.only]


def measurement(record: RunRecord) -> Measurement:
    """What the rule reads from one run (the probe at the capacity): the share meeting its class's TTFT target,
    and the share meeting the per-token target, each on its own."""
    s, slo = record.summary, record.summary.slo
    n = max(1, s.n_requests)
    untimed = replace(slo, ttft_ms=float("inf"), background_ttft_ms=float("inf"))
    ttft_ok = sum(1 for r in record.requests
                  if slo.miss(r) not in (SLOTarget.FINISHED, SLOTarget.TTFT, SLOTarget.BACKGROUND_TTFT)) / n
    tpot_ok = sum(1 for r in record.requests if untimed.miss(r) is None) / n
    return Measurement(
        goodput_per_s=s.goodput_per_s, slo_attainment=s.slo_attainment, ttft_attainment=ttft_ok,
        tpot_attainment=tpot_ok, ttft_ms_p99=s.ttft_ms.p99, itl_ms_p99=s.itl_ms.p99,
        interference_slowdown=s.interference.slowdown, interference_samples=s.interference.mixed_steps,
        n_requests=s.n_requests, n_failed=s.n_failed)


class Campaign:
    """Runs the campaign on this box.  ``store`` (optional) keeps the evidence; ``on_progress`` is called
    from the event loop after every probe."""

    def __init__(self, base: EngineConfig, settings: AdviseSettings, *, store=None, sampler=None,
                 on_progress: Callable[[Progress], None] | None = None, box=None, sources: dict | None = None):
        self.base, self.store, self.sampler = base, store, sampler
        # the engine's class budgets are the SLO unless the settings name one (the --slo-* flags)
        self.settings = settings if settings.slo else replace(settings, slo=SLO.from_budgets(base.class_budgets))
        self.slo: SLO = self.settings.slo
        # mix -> a trace source (``homepd.measure.trace.sources``: recorded traffic, a file) for mixes not built in
        self.sources = dict(sources or {})
        self.on_progress = on_progress or (lambda p: None)
        self.box = box
        self.records: dict[tuple[str, str, int], RunRecord] = {}   # the probe at the capacity, per repeat
        self.recovery: dict[str, RunRecord] = {}
        self.capacity: dict[tuple[str, str], CapacityCurve] = {}
        self.speeds: tuple[float | None, float | None] = (None, None)
        self._calibration_steps: list = []
        self._calibration_estimate: StepEstimate | None = None
        self._done, self._total, self._t0 = 0, 0, 0.0
        self._last: Progress | None = None   # the latest step's progress, and when it was said (the ticker's)
        self._last_s = 0.0
        self._deadline: float | None = None   # the end of the current stage's share of the wall budget
        self._searches_left = 0
        self._screened: dict[tuple[str, str], object] = {}  # (candidate, mix) -> the screen's SearchOutcome
        self._n_probes = 0  # probes replayed so far: each one's requests are tagged with its number
        self.twins: dict[str, TwinEvidence] = {}  # candidate -> its twin (calibration, capacities, checks)
        self._pools: dict[str, tuple[Calibration, ...]] = {}  # candidate -> the earlier calibrations its twin pools
        self._hardware: dict | None = None
        self._recent_runs: list[Run] | None = None  # this box's recent runs, whose calibrations twins pool

    async def run(self) -> AdviseResult:
        self._t0 = time.monotonic()
        ticker = asyncio.ensure_future(self._tick())
        try:
            return await self._run()
        finally:
            ticker.cancel()

    async def _run(self) -> AdviseResult:
        setup = await asyncio.to_thread(prepare, self.base, pull=False)
        # one reading of the box for the plan and every candidate's placement
        self.box = box = self.box or await asyncio.to_thread(probe)
        plan = await asyncio.to_thread(placement_plan, self.base, setup.model_path, box)
        candidates = candidate_list(self.base, plan, self.settings)
        feasible = [c for c in candidates if c.feasible]
        s = self.settings
        probes_per_candidate = self._units_per_candidate()
        n_archs = len({c.mode for c in feasible})
        # why an upper bound, lowered as searches end early: the progress line never counts past its total
        self._total = (len(feasible) + (0 if s.quick else 1)) * probes_per_candidate + (n_archs if s.recovery else 0)
        if s.refine is not None:
            self._total += len(feasible) * sum(s.refine.max_probes * self._repeats(m) for m in s.mixes
                                               if not (s.twin and self._twinnable(m)))
        reserve = RECOVERY_RESERVE_S * n_archs if s.recovery else 0.0
        end = None if s.wall_budget_s is None else self._t0 + s.wall_budget_s - reserve
        screen_end = end if end is None or s.refine is None else self._t0 + (end - self._t0) * SCREEN_SHARE
        self._hardware = hardware = to_plain(to_dict(box, plan))
        run_id = None
        if self.store is not None:
            run_id = self.store.begin_run("advise", {"base": to_plain(self.base), "settings": to_plain(s)},
                                          hardware=hardware, trace=self._trace_description())
            for c in candidates:
                if not c.feasible:
                    self.store.add_infeasible(run_id, c.name, c.reason)
        status, error = "incomplete", None
        try:
            evidence = Evidence(list(candidates))
            calibration = next((c for c in feasible if c.name == chunk_candidate(CALIBRATION_CHUNK).name), None)
            ordered = ([calibration] if calibration else []) + [c for c in feasible if c is not calibration]
            predicted = None
            self._deadline, self._searches_left = screen_end, len(ordered) * len(s.mixes)
            for i, cand in enumerate(ordered):
                await self._measure(cand, evidence, run_id, s.mixes)
                if i == 0:
                    predicted = self._predicted_chunk()
                    if predicted is not None and predicted not in s.chunks and s.only is None and not s.quick:
                        self._searches_left += len(s.mixes)
                        extra = chunk_candidate(predicted, reason=f"predicted by the step-time model for ITL <= "
                                                                  f"{self.slo.itl_ms or self.base.itl_budget_ms:g} ms")
                        candidates.insert(len(s.chunks), extra)
                        evidence.candidates.insert(len(s.chunks), extra)
                        ordered.insert(i + 1, extra)
                    elif not s.quick:  # the slot kept for a predicted chunk (a quick campaign keeps none)
                        self._total -= probes_per_candidate
            evidence.not_exercised = not_exercised(candidates, self.records)
            if s.refine is not None:
                contenders = self._contenders(candidates, evidence)
                self._total = self._done + (n_archs if s.recovery else 0) + sum(
                    s.refine.max_probes * self._repeats(m) for mixes in contenders.values() for m in mixes)
                self._deadline = end
                self._searches_left = sum(self._repeats(m) for mixes in contenders.values() for m in mixes)
                for cand in (c for c in ordered if c.name in contenders):
                    await self._measure(cand, evidence, run_id, contenders[cand.name], refine=True)
                evidence.not_exercised = not_exercised(candidates, self.records)
            if s.recovery:
                for mode in dict.fromkeys(c.mode for c in feasible):
                    best = self._best_of(mode, evidence)
                    if best is not None:
                        await self._recovery(best, run_id)
            rec = recommend(evidence)
            self._total = self._done  # the recovery of an architecture without a best, a search that ended early
            self._report("recommendation")
            if self.store is not None:
                self.store.add_recommendation(run_id, advice_data(rec, self.capacity, candidates,
                                                                  evidence.not_exercised, self.twins),
                                              headline=_headline(rec))
            status = "complete"
            return AdviseResult(run_id, candidates, self.records, self.recovery, rec, s, hardware, predicted,
                                time.monotonic() - self._t0, dict(self.capacity), self.speeds, self.base,
                                dict(evidence.not_exercised), dict(self.twins))
        except Exception as exc:  # kept with the run; an interrupt (Ctrl-C, cancel) leaves it "incomplete"
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.store is not None:
                self.store.finish_run(run_id, status=status, error=error)

    # one candidate -----------------------------------------------------------------------------------
    def _config(self, cand: Candidate) -> EngineConfig:
        return replace(self.base, **cand.config_values())

    async def _measure(self, cand: Candidate, evidence: Evidence, run_id, mixes: tuple[str, ...],
                       refine: bool = False) -> None:
        """One engine for the candidate, reused by every probe of every search on it: the screen (one coarse
        search per mix) or the refinement (from the screen's probes on the fine grid, then repeats)."""
        s = self.settings
        config = self._config(cand)
        setup = await asyncio.to_thread(prepare, config, pull=False, box=self.box)
        async with Engine(config, setup, sampler=self.sampler) as engine:
            await self._warm_up(engine)
            cal = None
            if s.twin and not refine and any(self._twinnable(m) for m in mixes):
                cal = await self._calibrate_twin(engine, cand, config, run_id)
            elif self._done == 0 and self.speeds == (None, None):
                await self._calibrate(engine)
            for mix in mixes:
                if cal is not None and self._twinnable(mix):
                    await self._twin_search(engine, cand, config, cal, mix, evidence, run_id)
                    self._searches_left = max(0, self._searches_left - 1)
                    continue
                screened = self._screened.get((cand.name, mix))
                curves, repeats = [], range(self._repeats(mix) if refine else 1)
                for repeat in repeats:
                    seed = s.seed * 1000 + repeat
                    prior = screened if refine and repeat == 0 and screened is not None else None
                    start = curves[0].capacity_rps if curves and curves[0].capacity_rps else self._start_rate(mix)
                    outcome = await search_capacity(
                        cand.name, mix, start, self._budgeted(s.refine if refine else s.search), seed, self.slo,
                        lambda rate, n, seed, mix=mix, repeat=repeat: self._probe(engine, cand, mix, repeat, rate,
                                                                                  n, seed, run_id),
                        speeds=self.speeds, prior=prior.curve.probes if prior else (),
                        prior_records=prior.records if prior else None)
                    self._searches_left = max(0, self._searches_left - 1)
                    used = len(outcome.curve.probes) - (len(prior.curve.probes) if prior else 0)
                    self._total -= max(0, (s.refine if refine else s.search).max_probes - used)
                    curves.append(outcome.curve)
                    if not refine:
                        self._screened[(cand.name, mix)] = outcome
                    if refine and repeat == 0:  # the refinement's records replace the screen's
                        evidence.runs.pop((cand.name, mix), None)
                    if outcome.record_at_capacity is not None:
                        self.records[(cand.name, mix, repeat)] = outcome.record_at_capacity
                        evidence.add(cand.name, mix, measurement(outcome.record_at_capacity))
                self.capacity[(cand.name, mix)] = evidence.capacity[(cand.name, mix)] = combine(curves)

    def _units_per_candidate(self) -> int:
        """Progress units a candidate may take: its burst, and per mix its twin and checks, or a search's probes."""
        s = self.settings
        twinned = [m for m in s.mixes if s.twin and self._twinnable(m)]
        return (1 if twinned else 0) + len(twinned) * (1 + s.twin_checks) + \
            (len(s.mixes) - len(twinned)) * s.search.max_probes

    def _twinnable(self, mix: str) -> bool:
        return twinnable(self._trace(mix, 2, 1.0, 0))

    async def _calibrate_twin(self, engine, cand: Candidate, config: EngineConfig, run_id) -> Calibration:
        """The candidate's calibration burst (``homepd.twin.burst``); the first one also gives the box's prefill and
        decode speeds (where searches start, and the drain allowance) and, on a one-worker candidate, the step-time
        estimate the predicted chunk comes from."""
        s = self.settings
        self._report(f"{cand.name}: calibration burst", cand.name)
        trace = burst_trace(config, s.burst_per_sequence, max_tokens=s.max_tokens, long_tokens=s.long_tokens,
                            seed=s.seed * 1000 + BURST_SEED)
        t0 = time.monotonic()
        cal, record = await calibrate(engine, cand.name, trace, self.slo, self.sampler)
        if self.store is not None:  # the burst's requests and steps, as every probe's (the calibration comes at the end)
            self.store.add_result(run_id, cand.name, CALIBRATION_MIX, 0, record, steps=engine.steps_since(t0))
        if cal.unusable:   # the box was busy or stalling: once more, and the quieter of the two is kept
            self._report(f"{cand.name}: calibration burst again (the box was busy or stalled)", cand.name)
            t1 = time.monotonic()
            again, record_again = await calibrate(engine, cand.name, trace, self.slo, self.sampler)
            if self.store is not None:
                self.store.add_result(run_id, cand.name, CALIBRATION_MIX, 1, record_again,
                                      steps=engine.steps_since(t1))
            if quieter(cal, again) is again:
                cal, record, t0 = again, record_again, t1
        if self.speeds == (None, None):
            self.speeds = (record.summary.prompt_tok_s, record.summary.tpot_ms.p50)
            self._calibration_steps = engine.steps_since(t0)
            if config.mode.traits.single_worker:
                self._calibration_estimate = engine.step_estimate(Role.COLOCATED)
        self.twins[cand.name] = TwinEvidence(cand.name, cal, config=config)
        self._step_done(f"{cand.name}: calibrated", cand.name)
        return cal

    async def _twin_search(self, engine, cand: Candidate, config: EngineConfig, cal: Calibration, mix: str,
                           evidence: Evidence, run_id) -> None:
        """The candidate's capacity on ``mix`` from its twin, checked by measured probes at it
        (``homepd.advise.campaign.twinned``)."""
        s = self.settings
        mine = self.twins[cand.name]
        if not mine.capacities:  # the first mix: the earlier calibrations it pools are looked up once
            if self._recent_runs is None:  # the store is read once a campaign, for every candidate
                self._recent_runs = await asyncio.to_thread(recent_runs, self.store, run_id, self._hardware,
                                                            dt.datetime.now(dt.timezone.utc))
            earlier = earlier_calibrations(self._recent_runs, cand.name, cal, s.twin_pool)
            mine = self.twins[cand.name] = replace(mine, pooled_runs=tuple(r for r, _ in earlier))
            self._pools[cand.name] = tuple(c for _, c in earlier)
        pooled = f", pooled with run(s) {', '.join(map(str, mine.pooled_runs))}" if mine.pooled_runs else ""
        self._report(f"{cand.name}: the twin on the {mix} trace ({s.twin_seeds} seeds x {s.twin_requests} requests"
                     f"{pooled})", cand.name)
        search = TwinSearch(config, cal, mix, self.slo, self.speeds, self._budgeted(s.search),
                            make=lambda rate, n, seed: self._trace(mix, n, rate, seed),
                            tokenize=lambda r: engine.prepare(r.prompt, messages=list(r.messages) if r.messages
                                                              else None),
                            run_probe=lambda trace, rate, seed: self._check_probe(engine, cand, mix, trace, rate,
                                                                                  seed, run_id),
                            n_checks=s.twin_checks, steps_per_octave=s.twin_steps_per_octave,
                            check_requests=s.check_requests, n_seeds=s.twin_seeds, max_seeds=s.twin_max_seeds,
                            n_requests=s.twin_requests,
                            pool=self._pools.get(cand.name, ()), afford=self._affords,
                            check_span_s=s.check_span_s, half_width=s.twin_half_width)
        found = await search.run(self._start_rate(mix), seed=s.seed,
                                 on_simulated=lambda: self._step_done(f"{cand.name}: the twin done", cand.name))
        curve = found.outcome.curve
        self.capacity[(cand.name, mix)] = evidence.capacity[(cand.name, mix)] = curve
        self._screened[(cand.name, mix)] = found.outcome   # a refinement, where its twin was not trusted, goes on
        record = found.outcome.record_at_capacity or next(iter(found.outcome.records.values()), None)
        if record is not None:
            self.records[(cand.name, mix, 0)] = record
            evidence.add(cand.name, mix, measurement(record))
        mine = self.twins[cand.name]
        checks = mine.checks + found.checks
        trusted, why, error = verdict(checks)
        self.twins[cand.name] = replace(mine, capacities=mine.capacities + (found.twin,), checks=checks,
                                        trusted=trusted, why=why, attainment_error_points=error)

    async def _check_probe(self, engine, cand: Candidate, mix: str, trace, rate_rps: float, seed: int, run_id):
        """A twin's check: ``trace`` at ``rate_rps`` to its end (never stopped early: the twin simulates every
        request), tagged apart from the other probes; (the trace as it ran, its record, the engine's steps)."""
        self._report(f"{cand.name}: checking the twin at {rate_rps:.3g} req/s ({mix})", cand.name)
        self._n_probes += 1
        trace = tagged(trace, f"[probe {self._n_probes}] ")
        record = await run_trace(engine, trace, trace_name=f"{mix}@{rate_rps:.3g}/s", slo=self.slo,
                                 sampler=self.sampler)
        steps = engine.steps_since(record.requests[0].arrived_s) if record.requests else []
        if self.store is not None:
            self.store.add_result(run_id, cand.name, f"{mix}@{rate_rps:.3g}/s", 0, record, steps=steps)
        self._step_done(f"{cand.name}: checked at {rate_rps:.3g} req/s", cand.name)
        return trace, record, steps

    def _repeats(self, mix: str) -> int:
        """Refined searches on ``mix``: ``repeats`` on the answer's mix (or when one mix is all there is: a
        given traffic), once elsewhere (a 30-minute budget on 2 cores holds no more)."""
        s = self.settings
        return s.repeats if mix in s.repeat_mixes or len(s.mixes) == 1 else 1

    def _affords(self, seconds: float) -> bool:
        """Whether this search's share of the time left (as ``_budgeted`` shares it) holds ``seconds`` more.
        # why: the full campaign's second check on each mix (42 checks of 15-50 s) ran it to 2,309 s of its
        # 1,800 s budget; a check after the first is dropped once the budget is behind"""
        if self._deadline is None:
            return True
        return (self._deadline - time.monotonic()) / max(1, self._searches_left) >= seconds

    def _budgeted(self, search: SearchSettings) -> SearchSettings:
        """``search`` with its probe length from the SLO (``probe_span_s``) and its arrivals' budget cut to this
        search's share of the time left (at least one probe always runs)."""
        span = probe_span_s(self.slo.ttft_ms / 1e3, search.steps_per_octave)
        search = replace(search, probe_s=span)
        if self._deadline is None:
            return search
        share = (self._deadline - time.monotonic()) / max(1, self._searches_left) * PROBE_SHARE
        return replace(search, time_budget_s=max(1.0, min(search.time_budget_s, share)))

    def _contenders(self, candidates: list[Candidate], evidence: Evidence) -> dict[str, tuple[str, ...]]:
        """candidate name -> the mixes where it is its architecture's best on the screen (what the rule
        compares: the refinement measures those finer and on more seeds).  Not exercised ones are left out."""
        out: dict[str, list[str]] = {}
        by_name = {c.name: c for c in candidates}
        rank = {c.name: i for i, c in enumerate(candidates)}
        for mix in self.settings.mixes:
            if self.settings.twin and self._twinnable(mix):
                for name in self._open_twins(mix, by_name, evidence):
                    out.setdefault(name, []).append(mix)
                continue
            best: dict[Mode, tuple[float, int, str]] = {}
            for (name, m), curve in self.capacity.items():
                if m != mix or (name, m) in evidence.not_exercised or name not in by_name:
                    continue
                # why the rank: on a tie (no rate passed for any, often) the one its topology lists last, the
                # mode's best scheduler, is refined
                score = (curve.capacity_rps or 0.0, rank[name], name)
                mode = by_name[name].mode
                if mode not in best or score > best[mode]:
                    best[mode] = score
            for _, _, name in best.values():
                out.setdefault(name, []).append(mix)
        return {name: tuple(mixes) for name, mixes in out.items()}

    def _open_twins(self, mix: str, by_name: dict[str, Candidate], evidence: Evidence) -> list[str]:
        """On a mix the twins answered: per architecture, the candidate whose twin its checks did not confirm there
        (its curve the checks' own) with the most room above the architecture's best capacity, where that room
        is any (``answer_interval``).  # why: a full campaign left colocated-adaptive's mixed capacity at "under
        1.33 req/s" (its one check there ran the steps 1.39x slower than the burst and met 69 %), and ranked
        disaggregated-routed's 0.88 against colocated-unchunked's 0.46: a tie, where three quick runs had
        answered colocated-adaptive 1.09-1.30 against 0.77-0.81"""
        best: dict[Mode, float] = {}
        room: dict[Mode, tuple[float, str]] = {}
        for (name, m), curve in self.capacity.items():
            if m != mix or (name, m) in evidence.not_exercised or name not in by_name:
                continue
            mode = by_name[name].mode
            best[mode] = max(best.get(mode, 0.0), curve.capacity_rps or 0.0)
            top = answer_interval(curve)[1]
            if curve.source != TWIN_SOURCE and top > room.get(mode, (0.0, ""))[0]:
                room[mode] = (top, name)
        return [name for mode, (top, name) in room.items() if top > best[mode]]

    async def _probe(self, engine, cand: Candidate, mix: str, repeat: int, rate_rps: float, n_requests: int,
                     seed: int, run_id) -> RunRecord:
        s = self.settings
        self._report(f"{cand.name} on the {mix} trace at {rate_rps:.3g} req/s (repeat {repeat + 1}/{self._repeats(mix)})",
                     cand.name)
        # why the tag: every probe of a search replays the same seed's requests on the same engine, so without
        # it a probe was served from the KV the probes before it left in the prefix cache and the KV store
        # (colocated-adaptive "100 % at 4 req/s" on 2 cores): each probe is tagged apart, and its requests
        # still share what they share with each other
        self._n_probes += 1
        trace = tagged(self._trace(mix, n_requests, rate_rps, seed), f"[probe {self._n_probes}] ")
        record = await run_trace(engine, trace, trace_name=f"{mix}@{rate_rps:.3g}/s", slo=self.slo,
                                 sampler=self.sampler,
                                 stop_when=decided_failing(len(trace), self.slo, s.search.target_share))
        if self.store is not None:
            # why: one stored result per probe, its rate in the mix, so the history lists the curve
            self.store.add_result(run_id, cand.name, f"{mix}@{rate_rps:.3g}/s", repeat, record,
                                  steps=engine.steps_since(record.requests[0].arrived_s) if record.requests else [])
        self._step_done(f"{cand.name} on the {mix} trace at {rate_rps:.3g} req/s done", cand.name)
        return record

    async def _calibrate(self, engine) -> None:
        """The box's prefill and decode speeds, from a burst of the mixed trace's first requests at once on
        the first candidate (the calibration chunk): where every capacity search starts."""
        s = self.settings
        self._report("calibration: prefill and decode speeds")
        trace = make_trace("mixed", CALIBRATION_REQUESTS, 1.0, concurrency=CALIBRATION_REQUESTS,
                           max_tokens=s.max_tokens, long_tokens=s.long_tokens, ignore_eos=True, seed=s.seed)
        t0 = time.monotonic()
        record = await run_trace(engine, trace, trace_name="calibration", slo=self.slo, sampler=self.sampler)
        self.speeds = (record.summary.prompt_tok_s, record.summary.tpot_ms.p50)
        self._calibration_steps = engine.steps_since(t0)
        if engine.config.mode.traits.single_worker:
            self._calibration_estimate = engine.step_estimate(Role.COLOCATED)

    def _start_rate(self, mix: str) -> float:
        measured = sorted(c.capacity_rps for (_, m), c in self.capacity.items() if m == mix and c.capacity_rps)
        if measured:  # where the earlier candidates' edges are: one probe there usually brackets this one's
            return measured[len(measured) // 2]
        probe = self._trace(mix, 12, 1.0, self.settings.seed * 1000)  # built only when no edge is known yet
        prompt = sum(estimate_tokens(r.text) for r in probe) / len(probe)
        output = sum(r.max_tokens for r in probe) / len(probe)
        return start_rate_rps(self.speeds[0], self.speeds[1], prompt, output, utilisation=START_UTILISATION)

    async def _recovery(self, cand: Candidate, run_id) -> None:
        """The mixed trace at the candidate's capacity, with a worker killed once two requests stream."""
        import os
        import signal

        config = self._config(cand)
        victim = topology_for(cand.mode).recovery_victim(config)
        self._report(f"recovery: {cand.name}, a worker killed mid-run", cand.name)
        setup = await asyncio.to_thread(prepare, config, pull=False, box=self.box)
        curve = self.capacity.get((cand.name, "mixed"))
        # at the capacity; where nothing passed, at the slowest rate probed (never the raw estimate: on a crowded
        # box it can be hours of arrivals)
        rate = (curve.capacity_rps or min(p.rate_rps for p in curve.probes)) if curve and curve.probes \
            else max(self._start_rate("mixed"), 1.0)
        async with Engine(config, setup, sampler=self.sampler) as engine:
            await self._warm_up(engine)

            def kill_once_two_stream(_step) -> None:
                if engine.n_streaming() >= 2:
                    engine.step_listeners.remove(kill_once_two_stream)
                    os.kill(engine.worker_pid(victim), signal.SIGKILL)

            engine.step_listeners.append(kill_once_two_stream)
            record = await run_trace(engine, self._trace("mixed", RECOVERY_REQUESTS, rate, self.settings.seed * 1000),
                                     trace_name="mixed+kill", slo=self.slo, sampler=self.sampler)
            await engine.wait_restarts()  # the restart may end after the last request
            record = dataclasses.replace(record, worker_events=tuple(
                e for e in engine.worker_events if e.t_s >= record.requests[0].arrived_s))
        self.recovery[cand.mode] = record
        if self.store is not None:
            self.store.add_result(run_id, f"{cand.name}+kill:{victim}", "mixed+kill", 0, record)
        self._step_done(f"recovery: {cand.name} done", cand.name)

    async def _warm_up(self, engine) -> None:
        stream = await engine.submit("Hello", params=SamplingParams(max_tokens=2))
        await stream.collect()

    def _trace(self, mix: str, n_requests: int, rate_rps: float, seed: int):
        s = self.settings
        if mix in self.sources:  # recorded traffic or a file, its arrivals scaled to the probe's rate
            return self.sources[mix].trace(rate_rps=rate_rps, n_requests=n_requests, seed=seed)
        if mix == "chat":  # why: its rate counts conversations; turns of each arrive after think times
            return make_trace(mix, n_requests, rate_rps / CHAT_TURNS, max_tokens=s.max_tokens,
                              long_tokens=s.long_tokens, ignore_eos=True, seed=seed, name=mix)
        return make_trace(mix, n_requests, rate_rps, max_tokens=s.max_tokens, long_tokens=s.long_tokens,
                          ignore_eos=True, seed=seed, name=mix)

    def _trace_description(self) -> dict:
        s = self.settings
        return {"mixes": list(s.mixes), "repeats": s.repeats, "search": to_plain(s.search),
                "max_tokens": s.max_tokens, "long_tokens": s.long_tokens, "seed": s.seed, "arrival": "poisson",
                "ignore_eos": True, "rates": "searched: see the capacity curves",
                "given": {mix: source.describe() for mix, source in self.sources.items()}}

    def _predicted_chunk(self) -> int | None:
        return predicted_chunk(self._calibration_estimate, self._calibration_steps,
                               self.slo.itl_ms or self.base.itl_budget_ms)

    def _best_of(self, mode: Mode, evidence: Evidence) -> Candidate | None:
        mine = {c.name for c in evidence.candidates if c.mode is mode and c.feasible}
        rec = recommend(Evidence([c for c in evidence.candidates if c.name in mine],
                                 {k: v for k, v in evidence.runs.items() if k[0] in mine},
                                 {k: v for k, v in evidence.capacity.items() if k[0] in mine}))
        return rec.candidate

    def _step_done(self, current: str, candidate: str | None = None) -> None:
        """One unit of the campaign's progress is done (never past its total)."""
        self._done += 1
        self._total = max(self._total, self._done)
        self._report(current, candidate)

    def _report(self, current: str, candidate: str | None = None) -> None:
        now = time.monotonic()
        elapsed = now - self._t0
        eta = elapsed / self._done * (self._total - self._done) if self._done else None
        self._last = Progress(self._done, self._total, current, elapsed, self._bounded(eta, now), candidate)
        self._last_s = now
        self.on_progress(self._last)

    def _bounded(self, eta: float | None, now: float) -> float | None:
        """``eta`` bounded by the wall budget while some of it is left (the budget left where ``eta`` is None).
        # why not 0 past it: what is left still runs (a twin's first check always does), at the pace so far; a
        quick run on a slow hour read "ETA 0 s" for its last 30 s"""
        if self.settings.wall_budget_s is None:
            return eta
        left_s = self._t0 + self.settings.wall_budget_s - now
        if eta is None:
            return max(0.0, left_s)
        return min(eta, left_s) if left_s > 0 else eta

    def ticked(self, now: float) -> Progress | None:
        """The latest step's progress as of ``now``: its ETA counted down, and never under what the steps after the
        current one take at the pace so far.  # why: a stage runs 15-40 s, and the line's ETA stood still meanwhile"""
        last = self._last
        if last is None or last.done >= last.total:
            return None
        since = now - self._last_s
        eta = last.eta_s
        if eta is not None:
            after = (last.elapsed_s / last.done) * (last.total - last.done - 1) if last.done else 0.0
            eta = self._bounded(max(eta - since, after, 0.0), now)
        return replace(last, elapsed_s=last.elapsed_s + since, eta_s=eta)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_TICK_S)
            progress = self.ticked(time.monotonic())
            if progress is not None:
                self.on_progress(progress)


def predicted_chunk(estimate: StepEstimate | None, steps: list[StepRecord], itl_target_ms: float) -> int | None:
    """The chunk to try for ``itl_target_ms``: the prompt budget the serving step policy gives (``prompt_budget``,
    its share of the ITL and its error margin included) with the calibration worker's ``estimate``, beside the
    typical (median) decode batch and KV cells in use of its ``steps``, every decode interactive; at least
    ``MIN_PREDICTED_CHUNK``, rounded down to a power of two.  None while the worker had no trusted estimate."""
    if estimate is None:
        return None
    decoding = [st for st in steps if st.n_decode_tokens]
    n_decode = _median([st.n_decode_tokens for st in decoding]) if decoding else 1
    kv_in_use = _median([st.kv_in_use for st in decoding]) if decoding else 0
    # why a policy of its own: the chunk tried is a fixed chunk, so no idle cap, and its range is advise's
    policy = StepPolicy(None, MAX_PREDICTED_CHUNK + n_decode, itl_target_ms, estimate=lambda: estimate,
                        min_chunk=MIN_PREDICTED_CHUNK)
    chunk = max(MIN_PREDICTED_CHUNK, policy.budget_for(n_decode, n_decode, kv_in_use))
    return 1 << (chunk.bit_length() - 1)


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def _headline(rec: Recommendation) -> str:
    if rec.candidate is None:
        return "no recommendation: nothing could be measured"
    return f"{rec.candidate.name} ({rec.rule}, confidence {rec.confidence})"
