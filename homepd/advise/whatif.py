"""What-if: capacity planning in seconds from a stored run's calibration, with no engine and no measurement.

The questions a home lab asks of its box ("what if my traffic doubles", "what if documents are half my requests",
"what does a 150 ms gap budget buy", "would 6 sequences help") are changes to the traffic, the SLO or the
configuration.  Each calibrated candidate of the run (``TwinEvidence``: its calibration and configuration) is
simulated again with the change: the step policy's budgets follow the changed ITL and TTFT budgets (its workers'
specs are rebuilt from the changed configuration, as ``homepd.engine.specs`` builds them), the SLO is the changed
budgets, the traffic is the run's mix with the changed share of documents (or recorded traffic).  The answer is
marked "projected from run N's calibration": nothing was measured, and the twin's check on that run says how far
it can be trusted.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

from homepd.config import EngineConfig
from homepd.engine.specs import gap_ceiling_ms, idle_step_ms, itl_budget_ms
from homepd.errors import ConfigError
from homepd.measure.metrics import SLO
from homepd.measure.trace import make_trace
from homepd.measure.trace.model import tagged
from homepd.store.records import Run
from homepd.store.errors import RunNotFoundError
from homepd.twin.capacity import CapacityQuestion, twin_capacities
from homepd.twin.calibration import KV_FEATURE, Calibration
from homepd.twin.records import CALIBRATION_MIX, TwinCapacity, TwinEvidence
from homepd.twin.traces import TWIN_TAG, TraceRequests

# why fewer seeds and a coarser grid than the campaign's (20 x 200, 16 a octave): the answer is wanted in
# seconds, and it is a projection either way; the interval says how wide it is.  Why seeds in waves within a time
# budget, not a fixed number: a fixed 8 took 10.7-13.8 s on this 2-core box for a changed gap budget or sequence
# count (the capacity it searches moves with the change), and would take twice that on a slower one; the first
# wave always runs, and each further wave only where the budget still holds its time (the search's own time so
# far, per seed) and the interval is wider than the campaign's target
WHAT_IF_SEEDS = 4                # the first wave (the coarse bracket's seeds)
WHAT_IF_MORE_SEEDS = 2           # each further wave
WHAT_IF_MAX_SEEDS = 10
WHAT_IF_BUDGET_S = 7.0           # for the searches, from the projection's start (the command ends within ~10 s)
WHAT_IF_REQUESTS = 200
WHAT_IF_STEPS_PER_OCTAVE = 8     # a grid step of 9 %
SAME = object()              # a what-if field left as the run had it
REFERENCE_SEEDS = 4          # seeds the attainment at the changed rate is the mean over
# how each configuration field's change reads ("gap budget 150 ms")
CONFIG_LABELS = {"ttft_budget_ms": lambda v: f"TTFT budget {v:g} ms", "itl_budget_ms": lambda v: f"gap budget {v:g} ms",
                 "n_seq_max": lambda v: f"{v} sequences", "chunk": lambda v: f"chunk {v or 'none'}"}


@dataclass(frozen=True)
class WhatIf:
    """The change: ``rate_scale`` of the traffic's rate (with ``traffic_rps`` the reference: recorded traffic, or
    the run's recommended capacity), ``long_share`` of requests that are documents, the interactive class's
    ``ttft_budget_ms`` and ``itl_budget_ms``, ``n_seq_max`` and ``chunk`` (``SAME``: as the run had them)."""
    rate_scale: float | None = None
    long_share: float | None = None
    ttft_budget_ms: float | None = None
    itl_budget_ms: float | None = None
    n_seq_max: int | None = None
    chunk: object = SAME

    def describe(self) -> str:
        parts = []
        if self.rate_scale is not None:
            parts.append(f"traffic x{self.rate_scale:g}")
        if self.long_share is not None:
            parts.append(f"{self.long_share:.0%} documents")
        parts += [CONFIG_LABELS[name](value) for name, value in self.config_changes().items()]
        return ", ".join(parts) or "as measured"

    @property
    def same_capacity(self) -> bool:
        """Nothing but the rate changes: the capacity is the run's own."""
        return self.long_share is None and not self.config_changes()

    def config_changes(self) -> dict:
        """The ``EngineConfig`` fields the change sets (those left as the run had them left out)."""
        values = {"ttft_budget_ms": self.ttft_budget_ms, "itl_budget_ms": self.itl_budget_ms,
                  "n_seq_max": self.n_seq_max}
        changes = {name: v for name, v in values.items() if v is not None}
        if self.chunk is not SAME:
            changes["chunk"] = self.chunk
        return changes

    def config(self, config: EngineConfig) -> EngineConfig:
        changes = self.config_changes()
        return replace(config, **changes).validated() if changes else config


@dataclass(frozen=True)
class Projection:
    """One candidate under the change: its capacity as the run measured it, and as projected."""
    candidate: str
    trusted: bool
    check: str                              # the run's verdict on its twin
    measured_rps: float | None              # the run's twin capacity (the "run twin" column: not a measurement)
    projected: TwinCapacity
    reference_rps: float | None = None      # the traffic's rate after the change (rate_scale)
    attainment_at_reference: float | None = None
    reused: bool = False                    # the capacity is the run's own twin's (only the rate changed)


def calibrated(run: Run) -> list[TwinEvidence]:
    """The run's candidates with a twin to replay; a ConfigError saying what to run when there is none."""
    twins = [t for t in (run.advice.twins if run.advice else ()) if t.config is not None]
    if not twins:
        raise ConfigError(f"run {run.id} has no twin calibration (it predates the twin, or ran with --no-twin): "
                          "run `homepd advise --quick` first")
    return twins


def changed(twin: TwinEvidence, what: WhatIf) -> tuple[EngineConfig, Calibration]:
    """The candidate's configuration and calibration under the change: every worker's spec rebuilt from the changed
    configuration's budgets, sequences and chunk (the box's measured costs stay)."""
    config = what.config(twin.config)
    return config, respec(twin.calibration, config)


def respec(cal: Calibration, config: EngineConfig) -> Calibration:
    """``cal`` with every worker's spec rebuilt from ``config``'s budgets, sequences and chunk."""
    workers = []
    for w in cal.workers:
        spec = replace(w.spec, n_seq_max=config.n_seq_max, chunk=config.chunk,
                       itl_budget_ms=itl_budget_ms(config, w.spec.role), idle_step_ms=idle_step_ms(config, w.spec.role),
                       gap_ceiling_ms=gap_ceiling_ms(config, w.spec.role))
        workers.append(replace(w, spec=spec))
    return replace(cal, workers=tuple(workers))


def project(run: Run, what: WhatIf, tokenize, *, traffic=None, n_seeds: int = WHAT_IF_SEEDS,
            n_requests: int = WHAT_IF_REQUESTS, processes: int | None = None,
            pools: dict[str, tuple[Calibration, ...]] | None = None, max_seeds: int | None = None,
            budget_s: float | None = WHAT_IF_BUDGET_S) -> list[Projection]:
    """Every calibrated candidate of ``run`` under ``what``; ``tokenize(trace_request)`` -> prompt ids (a
    ``PromptTokenizer`` of the run's model); ``traffic``: a recorded-traffic source (its arrivals and prompts) in
    place of the run's mix; ``pools``: candidate -> the earlier calibrations its twin pooled in the run
    (``pooled_calibrations``), which the projection pools too, so that its twin is the run's.  ``n_seeds`` first,
    then waves of ``WHAT_IF_MORE_SEEDS`` up to ``max_seeds`` (default ``WHAT_IF_MAX_SEEDS``, at least
    ``n_seeds``) while ``budget_s`` (None: no budget, every wave) holds them."""
    t0 = time.monotonic()
    max_seeds = max(n_seeds, WHAT_IF_MAX_SEEDS if max_seeds is None else max_seeds)
    affords = None if budget_s is None else lambda seconds: time.monotonic() + seconds <= t0 + budget_s
    twins = calibrated(run)
    settings = run.config
    if traffic is not None:
        make = lambda rate, n, seed: traffic.trace(rate_rps=rate, n_requests=n, seed=seed)  # noqa: E731
        base_rps = traffic.describe().get("rate_per_s")
    else:
        make = lambda rate, n, seed: make_trace(  # noqa: E731
            "mixed", n, rate, max_tokens=settings.max_tokens, long_tokens=settings.long_tokens, ignore_eos=True,
            seed=seed, long_share=what.long_share)
        recommended = run.advice.candidate.name if run.advice and run.advice.candidate else twins[0].candidate
        base_rps = next((c.capacity_rps for c in run.advice.capacity if c.candidate == recommended
                          and c.capacity_rps is not None), None)
    requests = TraceRequests(lambda rate, n, seed: tagged(make(rate, n, seed), TWIN_TAG), n_requests, tokenize)
    reference = base_rps * what.rate_scale if base_rps and what.rate_scale is not None else None
    # why: a change of the traffic's rate alone leaves the capacity question as the run answered it (on more seeds
    # and a finer grid than a what-if affords): only the attainment at the new rate is new
    # (its wall_s 0: this what-if spent nothing on it)
    stored = {t.candidate: replace(cap, wall_s=0.0) if what.same_capacity and traffic is None
              and (cap := _stored_capacity(t)) is not None else None for t in twins}
    searched = any(cap is None for cap in stored.values())
    requests.prepare(range(max_seeds if searched else min(n_seeds, REFERENCE_SEEDS)))
    speeds = _speeds(run)
    # every candidate's search and reference runs go to one pool together (its rounds filled by all of them)
    plans, questions, references = [], [], []
    for twin in twins:
        config, cal = changed(twin, what)
        pool = tuple(respec(c, config) for c in (pools or {}).get(twin.candidate, ()))
        slo = SLO.from_budgets(config.class_budgets, token_target=settings.slo.token_target)
        before = _stored_capacity(twin)
        question = CapacityQuestion(config, cal, requests, slo, speeds,
                                    before.capacity_rps if before and before.capacity_rps else 1.0,
                                    n_seeds=n_seeds, n_requests=n_requests, max_seeds=max_seeds,
                                    more_seeds=WHAT_IF_MORE_SEEDS, affords=affords,
                                    steps_per_octave=WHAT_IF_STEPS_PER_OCTAVE, pool=pool, at_half=False)
        plans.append((twin, before))
        if stored[twin.candidate] is None:
            questions.append(question)
        if reference is not None:
            references.append((question, reference, range(min(n_seeds, REFERENCE_SEEDS))))
    capacities, reference_runs = twin_capacities(questions, processes, references) if questions or references \
        else ([], [])
    searched_caps, runs_at = iter(capacities), iter(reference_runs)
    out = []
    for twin, before in plans:
        projected = stored[twin.candidate] or next(searched_caps)
        attainment = statistics.mean(f.attainment for f in next(runs_at)) if reference is not None else None
        out.append(Projection(twin.candidate, twin.trusted, twin.why, before.capacity_rps if before else None,
                              projected, reference, attainment, reused=stored[twin.candidate] is not None))
    return out


def pooled_calibrations(store, run: Run) -> dict[str, tuple[Calibration, ...]]:
    """candidate -> the calibrations of the earlier runs its twin pooled in ``run`` (``TwinEvidence.pooled_runs``),
    read from ``store``; a run since deleted, or one without that candidate, is left out."""
    out: dict[str, tuple[Calibration, ...]] = {}
    loaded: dict[int, Run | None] = {}
    for twin in calibrated(run):
        cals = []
        for run_id in twin.pooled_runs:
            if run_id not in loaded:
                try:
                    loaded[run_id] = store.load_run(run_id, timelines=False)
                except RunNotFoundError:
                    loaded[run_id] = None
            earlier = loaded[run_id]
            match = earlier.advice.twin(twin.candidate) if earlier and earlier.advice else None
            if match is not None:
                cals.append(match.calibration)
        out[twin.candidate] = tuple(cals)
    return out


def _stored_capacity(twin: TwinEvidence) -> TwinCapacity | None:
    """The run's twin capacity of the candidate: on the mixed trace, else its first."""
    return twin.capacity("mixed") or (twin.capacities[0] if twin.capacities else None)


def _speeds(run: Run) -> tuple[float | None, float | None]:
    """The box's prefill tok/s and decode step ms as the run's calibration measured them (the drain allowance)."""
    for probe in run.measured:
        if probe.mix == CALIBRATION_MIX:
            return probe.prompt_tok_s, probe.tpot_p50_ms
    return None, None


def render(run: Run, what: WhatIf, projections: list[Projection]) -> str:
    """The projection as text, marked as projected from the run's calibration."""
    lines = [f"projected from run {run.id}'s calibration ({run.started_at or 'date unknown'}): {what.describe()}",
             f"{'candidate':<26} {'run twin':>9} {'projected':>10} {'interval':>16} {'twin checked':>13}"]
    for p in sorted(projections, key=lambda p: -(p.projected.capacity_rps or 0.0)):
        iv = p.projected.interval_rps
        lines.append(f"{p.candidate:<26} {_rps(p.measured_rps):>9} {_rps(p.projected.capacity_rps):>10} "
                     f"{f'[{iv[0]:.2f}-{iv[1]:.2f}]' if iv else 'NA':>16} {'yes' if p.trusted else 'NO':>13}")
        if p.reference_rps is not None:
            lines.append(f"  at {p.reference_rps:.2f} req/s: {p.attainment_at_reference:.0%} of requests within the SLO")
    # why among the trusted: a run's full campaign refined replicas-2 by measurement to 0.60 req/s on the mixed
    # trace after its checks refused its twin (5 of 16 met at the twin's 1.48), and what-if named it the best at 1.48
    trusted = [p for p in projections if p.trusted] or projections
    best = max(trusted, key=lambda p: p.projected.capacity_rps or 0.0)
    lines.append(f"best under this change: {best.candidate} ({_rps(best.projected.capacity_rps)} req/s, "
                 f"{best.projected.n_seeds} seeds x {best.projected.n_requests} requests, "
                 f"{max(p.projected.wall_s for p in projections):.1f} s, the candidates searched together)"
                 + ("" if best.trusted else "; no twin of the run was trusted"))
    top = best.projected.capacity_rps or 0.0
    above = [p.candidate for p in projections if not p.trusted and best.trusted and
             (p.projected.capacity_rps or 0.0) > top]
    if above:
        lines.append(f"  {', '.join(above)} project higher, but the run's checks did not trust their twins")
    if all(p.reused for p in projections):
        lines.append("only the rate changed: each capacity is the run's own twin's; the attainment at the new rate "
                     "is projected")
    older = [t.candidate for t in calibrated(run) if t.calibration.kv_feature != KV_FEATURE]
    if older:
        lines.append(f"note: run {run.id} priced the steps of {', '.join(older)} by an older count of the KV cells "
                     "a step attends over than this version plans with: the projection is off by that (a new "
                     "`homepd advise` calibrates again)")
    untrusted = [p.candidate for p in projections if not p.trusted]
    if untrusted:
        lines.append(f"note: the run's check did not trust the twin of {', '.join(untrusted)}: its projection is a "
                     "guess")
    return "\n".join(lines)


def _rps(value: float | None) -> str:
    return "NA" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"



