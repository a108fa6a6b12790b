"""The advise campaign: every feasible architecture on identical traces, stored as evidence, then the rule.

probe -> placement plan -> candidates (colocated unchunked and chunked, the chunk the calibration worker's own
step-time model gives for the ITL target, as its step policy would budget it, disaggregated, replicas;
infeasible ones with their reason) -> for each candidate, one engine, the short / long / mixed traces (same
seeds for every candidate) -> a recovery scenario per architecture (a worker killed mid-run) -> ``recommend``
-> store.  Never changes the serving configuration: ``homepd advise apply`` is a separate step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from homepd.advise.recommend import Candidate, Evidence, Measurement, Recommendation, recommend
from homepd.config import EngineConfig
from homepd.core.modes import Mode, Role
from homepd.core.records import WorkerEventKind, to_plain
from homepd.core.protocol import StepRecord
from homepd.core.sampling import SamplingParams
from homepd.core.stepmodel import StepEstimate
from homepd.core.steppolicy import prompt_budget
from homepd.engine.controller import Engine
from homepd.engine.topology import topology_for
from homepd.engine.topology.colocated import chunk_candidate
from homepd.launch import placement_plan, prepare
from homepd.measure.metrics import SLO
from homepd.measure.replay import RunRecord, run_trace
from homepd.measure.trace import make_trace

CALIBRATION_CHUNK = 256
# why: below this a long prompt needs hundreds of steps; when the model says even an empty step misses the
# target, the smallest chunk still helps more than an unbounded one, and the evidence shows the cost
MIN_PREDICTED_CHUNK = 16
MAX_PREDICTED_CHUNK = 2048


@dataclass(frozen=True)
class AdviseSettings:
    """How big the campaign is; ``quick`` sizes it for about 2 minutes on a 2-core box, the full one for 10."""
    quick: bool = False
    mixes: tuple[str, ...] = ("short", "long", "mixed", "chat")
    repeats: int = 2
    chunks: tuple[int | None, ...] = (None, 32, 64, 128, CALIBRATION_CHUNK)
    # chat: 8 turns in 2 conversations of 4, starting at 0.5 conversations/s (homepd.measure.trace.conversations)
    n_requests: dict = field(default_factory=lambda: {"short": 8, "long": 3, "mixed": 8, "chat": 8})
    rate_per_s: dict = field(default_factory=lambda: {"short": 4.0, "long": 0.5, "mixed": 2.0, "chat": 0.5})
    max_tokens: int = 32
    long_tokens: int = 400
    recovery: bool = True
    seed: int = 0
    slo: SLO = field(default_factory=SLO)  # the interactive class's budgets, per-token as TPOT

    @classmethod
    def quick_settings(cls, **kw) -> "AdviseSettings":
        base = dict(quick=True, mixes=("short", "long", "mixed"), repeats=1, chunks=(None, CALIBRATION_CHUNK),
                    n_requests={"short": 4, "long": 2, "mixed": 4},
                    rate_per_s={"short": 4.0, "long": 1.0, "mixed": 2.0}, max_tokens=24, long_tokens=300,
                    recovery=False)
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


def candidate_list(base: EngineConfig, plan, settings: AdviseSettings) -> list[Candidate]:
    """The configurations to measure on this box; infeasible ones carry the plan's reason."""
    return [c for mode in Mode for c in topology_for(mode).advise_candidates(base, plan, settings.chunks)]


def measurement(record: RunRecord) -> Measurement:
    """What the rule reads from one run."""
    s, slo = record.summary, record.summary.slo
    done = [r for r in record.requests if r.state.value == "finished"]
    n = max(1, s.n_requests)
    ttft_ok = sum(1 for r in done if r.ttft_s is not None and r.ttft_s * 1e3 <= slo.ttft_ms) / n
    tpot_ok = sum(1 for r in done if r.tpot_s is None or r.tpot_s * 1e3 <= slo.tpot_ms) / n
    return Measurement(
        goodput_per_s=s.goodput_per_s, slo_attainment=s.slo_attainment, ttft_attainment=ttft_ok,
        tpot_attainment=tpot_ok, ttft_ms_p99=s.ttft_ms.p99, itl_ms_p99=s.itl_ms.p99,
        interference_slowdown=s.interference.slowdown, interference_samples=s.interference.mixed_steps,
        n_requests=s.n_requests, n_failed=s.n_failed)


class Campaign:
    """Runs the campaign on this box.  ``store`` (optional) keeps the evidence; ``on_progress`` is called
    from the event loop after every run."""

    def __init__(self, base: EngineConfig, settings: AdviseSettings, *, store=None, sampler=None,
                 on_progress: Callable[[Progress], None] | None = None, box=None, sources: dict | None = None):
        self.base, self.settings, self.store, self.sampler = base, settings, store, sampler
        # mix -> a trace source (``homepd.measure.trace.sources``: recorded traffic, a file) for mixes not built in
        self.sources = dict(sources or {})
        self.on_progress = on_progress or (lambda p: None)
        self.box = box
        self.records: dict[tuple[str, str, int], RunRecord] = {}
        self.recovery: dict[str, RunRecord] = {}
        self._steps: dict[str, list] = {}   # candidate -> its step log
        self._estimates: dict[str, StepEstimate | None] = {}  # candidate -> its worker's last published estimate
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
        runs_per_candidate = len(s.mixes) * s.repeats
        n_archs = len({c.mode for c in feasible})
        self._total = (len(feasible) + 1) * runs_per_candidate + (n_archs if s.recovery else 0)
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
                if cand is calibration:
                    predicted = self._predicted_chunk(cand)
                    if predicted is not None and predicted not in s.chunks:
                        extra = chunk_candidate(predicted, reason=f"predicted by the step-time model for ITL <= "
                                                                  f"{s.slo.itl_ms or s.slo.tpot_ms:g} ms")
                        candidates.insert(len(s.chunks), extra)
                        evidence.candidates.insert(len(s.chunks), extra)
                        ordered.insert(i + 1, extra)
                    else:
                        self._total -= runs_per_candidate
            if s.recovery:
                for mode in dict.fromkeys(c.mode for c in feasible):
                    best = self._best_of(mode, evidence)
                    if best is not None:
                        await self._recovery(best, run_id)
            rec = recommend(evidence)
            if self.store is not None:
                self.store.add_recommendation(run_id, to_plain(rec), headline=_headline(rec))
            status = "complete"
            return AdviseResult(run_id, candidates, self.records, self.recovery, rec, s, hardware, predicted,
                                time.monotonic() - self._t0)
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
        s = self.settings
        config = self._config(cand)
        setup = await asyncio.to_thread(prepare, config, pull=False, box=self.box)
        async with Engine(config, setup, sampler=self.sampler) as engine:
            await self._warm_up(engine)
            for mix in s.mixes:
                for repeat in range(s.repeats):
                    self._report(f"{cand.name} on the {mix} trace (repeat {repeat + 1}/{s.repeats})")
                    record = await run_trace(engine, self._trace(mix, repeat), trace_name=mix, slo=s.slo,
                                             sampler=self.sampler)
                    self.records[(cand.name, mix, repeat)] = record
                    evidence.add(cand.name, mix, measurement(record))
                    if self.store is not None:
                        self.store.add_result(run_id, cand.name, mix, repeat, record,
                                              steps=engine.steps_since(record.requests[0].arrived_s)
                                              if record.requests else [])
                    self._done += 1
                    self._report(f"{cand.name} on the {mix} trace done")
            self._steps[cand.name] = engine.steps_since()
            if cand.mode is Mode.COLOCATED:
                self._estimates[cand.name] = engine.step_estimate(Role.COLOCATED)

    async def _recovery(self, cand: Candidate, run_id) -> None:
        """The mixed trace with a worker killed once the second request has its first token."""
        import os
        import signal

        config = self._config(cand)
        victim = topology_for(cand.mode).recovery_victim(config)
        self._report(f"recovery: {cand.name}, a worker killed mid-run")
        setup = await asyncio.to_thread(prepare, config, pull=False, box=self.box)
        async with Engine(config, setup, sampler=self.sampler) as engine:
            await self._warm_up(engine)

            def kill_once_two_stream(_step) -> None:
                if engine.n_streaming() >= 2:
                    engine.step_listeners.remove(kill_once_two_stream)
                    os.kill(engine.worker_pid(victim), signal.SIGKILL)

            engine.step_listeners.append(kill_once_two_stream)
            record = await run_trace(engine, self._trace("mixed", 0), trace_name="mixed+kill",
                                     slo=self.settings.slo, sampler=self.sampler)
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

    def _trace(self, mix: str, repeat: int):
        s = self.settings
        if mix in self.sources:
            return self.sources[mix].trace(seed=s.seed * 1000 + repeat)
        return make_trace(mix, s.n_requests[mix], s.rate_per_s[mix], max_tokens=s.max_tokens,
                          long_tokens=s.long_tokens, ignore_eos=True, seed=s.seed * 1000 + repeat, name=mix)

    def _trace_description(self) -> dict:
        s = self.settings
        return {"mixes": list(s.mixes), "repeats": s.repeats, "n_requests": s.n_requests,
                "rate_per_s": s.rate_per_s, "max_tokens": s.max_tokens, "long_tokens": s.long_tokens,
                "seed": s.seed, "arrival": "poisson", "ignore_eos": True,
                "given": {mix: source.describe() for mix, source in self.sources.items()}}

    def _predicted_chunk(self, cand: Candidate) -> int | None:
        return predicted_chunk(self._estimates.get(cand.name), self._steps.get(cand.name, []),
                               self.settings.slo.itl_ms or self.settings.slo.tpot_ms)

    def _best_of(self, mode: Mode, evidence: Evidence) -> Candidate | None:
        rec = recommend(Evidence([c for c in evidence.candidates if c.mode is mode and c.feasible],
                                 {k: v for k, v in evidence.runs.items()
                                  if any(c.name == k[0] and c.mode is mode for c in evidence.candidates)}))
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
