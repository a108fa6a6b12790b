"""The advise campaign: every feasible architecture's capacity on identical traces, stored as evidence, then
the rule.

probe -> placement plan -> candidates (colocated unchunked and chunked, the chunk the calibration worker's own
step-time model gives for the ITL target, as its step policy would budget it, the adaptive chunk, disaggregated
with every prompt handed off and with learned routing, replicas; infeasible ones with their reason) -> a
calibration burst on the first candidate (the box's prefill and decode speeds: where every search starts) -> for each candidate, one engine, and per mix (and repeat) a capacity
search (``homepd.advise.capacity``: probes at rates on one grid, each a seeded trace, the same trace for every
candidate at the same rate) -> which runs did not exercise their architecture (not ranked) -> a recovery
scenario per architecture (a worker killed mid-run) -> ``recommend``
-> store.  Never changes the serving configuration: ``homepd advise apply`` is a separate step.

Quick: the mixed trace only, one repeat, a grid of 2 steps per octave (a factor 1.41) and 3 probes a search;
full: every mix, two repeats, 4 steps per octave (1.19) and up to 6 probes.  The quick grid is a subset of
the full one, so their answers can only differ within the quick answer's interval (``answer_interval``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from homepd.advise.capacity import CapacityCurve, SearchSettings, combine, start_rate_rps
from homepd.advise.probes import search_capacity
from homepd.advise.exercised import not_exercised
from homepd.advise.recommend import Candidate, Evidence, Measurement, Recommendation, recommend
from homepd.config import EngineConfig
from homepd.core.modes import Mode, Role
from homepd.core.records import WorkerEventKind, to_plain
from homepd.core.protocol import StepRecord
from homepd.core.sampling import SamplingParams
from homepd.core.stepmodel import StepEstimate
from homepd.core.steppolicy import prompt_budget
from homepd.engine.controller import Engine
from homepd.errors import ConfigError
from homepd.engine.topology import topology_for
from homepd.engine.topology.colocated import chunk_candidate
from homepd.launch import placement_plan, prepare
from homepd.measure.metrics import SLO, SLOTarget
from homepd.measure.replay import RunRecord, run_trace
from homepd.measure.trace import make_trace
from homepd.measure.trace.conversations import CHAT_TURNS
from homepd.measure.trace.model import estimate_tokens

CALIBRATION_CHUNK = 256
# why: below this a long prompt needs hundreds of steps; when the model says even an empty step misses the
# target, the smallest chunk still helps more than an unbounded one, and the evidence shows the cost
MIN_PREDICTED_CHUNK = 16
MAX_PREDICTED_CHUNK = 2048
CALIBRATION_REQUESTS = 4          # the calibration burst: the mixed trace's first requests, all at once
RECOVERY_REQUESTS = 8
FULL_SEARCH = SearchSettings(steps_per_octave=4, grow_steps=4, max_probes=6, time_budget_s=60.0, probe_s=12.0,
                             max_requests=24)
QUICK_SEARCH = SearchSettings(steps_per_octave=2, grow_steps=2, max_probes=3, time_budget_s=24.0, probe_s=6.0,
                              max_requests=12)


@dataclass(frozen=True)
class AdviseSettings:
    """How big the campaign is; ``quick`` sizes it for about 2 minutes on a 2-core box.  ``slo`` None: the
    engine's class budgets (``EngineConfig.class_budgets``) are the SLO."""
    quick: bool = False
    mixes: tuple[str, ...] = ("short", "long", "mixed", "chat")
    repeats: int = 2
    chunks: tuple[int | None, ...] = (None, 32, 128, CALIBRATION_CHUNK)
    search: SearchSettings = FULL_SEARCH
    max_tokens: int = 32
    long_tokens: int = 400
    recovery: bool = True
    seed: int = 0
    slo: SLO | None = None
    only: tuple[str, ...] | None = None  # measure just these candidates (``--candidates``); None: every one

    @classmethod
    def quick_settings(cls, **kw) -> "AdviseSettings":
        base = dict(quick=True, mixes=("mixed",), repeats=1, chunks=(None, CALIBRATION_CHUNK),
                    search=QUICK_SEARCH, max_tokens=24, long_tokens=300, recovery=False)
        base.update(kw)
        return cls(**base)


@dataclass(frozen=True)
class Progress:
    """Where the campaign is: runs done of the total, the current step, elapsed and estimated time left."""
    done: int
    total: int
    current: str
    elapsed_s: float
    eta_s: float | None


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


def candidate_list(base: EngineConfig, plan, settings: AdviseSettings) -> list[Candidate]:
    """The configurations to measure on this box; infeasible ones carry the plan's reason.  With
    ``settings.only``, just those (a name that is not a candidate here is a ConfigError listing them)."""
    every = [c for mode in Mode for c in topology_for(mode).advise_candidates(base, plan, settings.chunks)]
    if settings.only is None:
        return every
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

    async def run(self) -> AdviseResult:
        from homepd.hw.probe import probe, to_dict

        self._t0 = time.monotonic()
        setup = await asyncio.to_thread(prepare, self.base, pull=False)
        # one reading of the box for the plan and every candidate's placement
        self.box = box = self.box or await asyncio.to_thread(probe)
        plan = await asyncio.to_thread(placement_plan, self.base, setup.model_path, box)
        candidates = candidate_list(self.base, plan, self.settings)
        feasible = [c for c in candidates if c.feasible]
        s = self.settings
        probes_per_candidate = len(s.mixes) * s.repeats * s.search.max_probes
        n_archs = len({c.mode for c in feasible})
        self._total = (len(feasible) + 1) * probes_per_candidate + (n_archs if s.recovery else 0)
        hardware = to_plain(to_dict(box, plan))
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
            for i, cand in enumerate(ordered):
                await self._measure(cand, evidence, run_id)
                if i == 0:
                    predicted = self._predicted_chunk()
                    if predicted is not None and predicted not in s.chunks and s.only is None:
                        extra = chunk_candidate(predicted, reason=f"predicted by the step-time model for ITL <= "
                                                                  f"{self.slo.itl_ms or self.base.itl_budget_ms:g} ms")
                        candidates.insert(len(s.chunks), extra)
                        evidence.candidates.insert(len(s.chunks), extra)
                        ordered.insert(i + 1, extra)
                    else:
                        self._total -= probes_per_candidate
            evidence.not_exercised = not_exercised(candidates, self.records)
            if s.recovery:
                for mode in dict.fromkeys(c.mode for c in feasible):
                    best = self._best_of(mode, evidence)
                    if best is not None:
                        await self._recovery(best, run_id)
            rec = recommend(evidence)
            if self.store is not None:
                # with every candidate's configuration: `homepd advise apply --candidate` may choose any of them
                data = {**to_plain(rec), "capacity": [to_plain(c) for c in self.capacity.values()],
                        "candidates": to_plain(candidates),
                        "not_exercised": [{"candidate": c, "mix": m, "reason": why}
                                          for (c, m), why in evidence.not_exercised.items()]}
                self.store.add_recommendation(run_id, data, headline=_headline(rec))
            status = "complete"
            return AdviseResult(run_id, candidates, self.records, self.recovery, rec, s, hardware, predicted,
                                time.monotonic() - self._t0, dict(self.capacity), self.speeds)
        except Exception as exc:  # kept with the run; an interrupt (Ctrl-C, cancel) leaves it "incomplete"
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.store is not None:
                self.store.finish_run(run_id, status=status, error=error)

    # one candidate -----------------------------------------------------------------------------------
    def _config(self, cand: Candidate) -> EngineConfig:
        return replace(self.base, **cand.config_values())

    async def _measure(self, cand: Candidate, evidence: Evidence, run_id) -> None:
        """One engine for the candidate, reused by every probe of every search on it."""
        s = self.settings
        config = self._config(cand)
        setup = await asyncio.to_thread(prepare, config, pull=False, box=self.box)
        async with Engine(config, setup, sampler=self.sampler) as engine:
            await self._warm_up(engine)
            if self._done == 0 and self.speeds == (None, None):
                await self._calibrate(engine)
            for mix in s.mixes:
                curves = []
                for repeat in range(s.repeats):
                    seed = s.seed * 1000 + repeat
                    outcome = await search_capacity(
                        cand.name, mix, self._start_rate(mix), s.search, seed, self.slo,
                        lambda rate, n, seed, mix=mix, repeat=repeat: self._probe(engine, cand, mix, repeat, rate,
                                                                                  n, seed, run_id))
                    self._total -= s.search.max_probes - len(outcome.curve.probes)
                    curves.append(outcome.curve)
                    if outcome.record_at_capacity is not None:
                        self.records[(cand.name, mix, repeat)] = outcome.record_at_capacity
                        evidence.add(cand.name, mix, measurement(outcome.record_at_capacity))
                self.capacity[(cand.name, mix)] = evidence.capacity[(cand.name, mix)] = combine(curves)

    async def _probe(self, engine, cand: Candidate, mix: str, repeat: int, rate_rps: float, n_requests: int,
                     seed: int, run_id) -> RunRecord:
        s = self.settings
        self._report(f"{cand.name} on the {mix} trace at {rate_rps:.3g} req/s (repeat {repeat + 1}/{s.repeats})")
        trace = self._trace(mix, n_requests, rate_rps, seed)
        record = await run_trace(engine, trace, trace_name=f"{mix}@{rate_rps:.3g}/s", slo=self.slo,
                                 sampler=self.sampler)
        if self.store is not None:
            # why: one stored result per probe, its rate in the mix, so the history lists the curve
            self.store.add_result(run_id, cand.name, f"{mix}@{rate_rps:.3g}/s", repeat, record,
                                  steps=engine.steps_since(record.requests[0].arrived_s) if record.requests else [])
        self._done += 1
        self._report(f"{cand.name} on the {mix} trace at {rate_rps:.3g} req/s done")
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
        if engine.config.mode is Mode.COLOCATED:
            self._calibration_estimate = engine.step_estimate(Role.COLOCATED)

    def _start_rate(self, mix: str) -> float:
        probe = self._trace(mix, 12, 1.0, self.settings.seed * 1000)
        prompt = sum(estimate_tokens(r.text) for r in probe) / len(probe)
        output = sum(r.max_tokens for r in probe) / len(probe)
        return start_rate_rps(self.speeds[0], self.speeds[1], prompt, output)

    async def _recovery(self, cand: Candidate, run_id) -> None:
        """The mixed trace at the candidate's capacity, with a worker killed once two requests stream."""
        import os
        import signal

        config = self._config(cand)
        victim = topology_for(cand.mode).recovery_victim(config)
        self._report(f"recovery: {cand.name}, a worker killed mid-run")
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
        self._done += 1

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

    def _report(self, current: str) -> None:
        elapsed = time.monotonic() - self._t0
        eta = elapsed / self._done * (self._total - self._done) if self._done else None
        self.on_progress(Progress(self._done, self._total, current, elapsed, eta))


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
    chunk = prompt_budget(estimate, n_decode, n_decode, itl_target_ms, kv_in_use=kv_in_use,
                          min_chunk=MIN_PREDICTED_CHUNK, max_chunk=MAX_PREDICTED_CHUNK)
    return 1 << (chunk.bit_length() - 1)


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def _headline(rec: Recommendation) -> str:
    if rec.candidate is None:
        return "no recommendation: nothing could be measured"
    return f"{rec.candidate.name} ({rec.rule}, confidence {rec.confidence})"
