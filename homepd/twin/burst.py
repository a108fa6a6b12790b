"""The calibration burst: a short measured run on the candidate's own engine that covers the step model's range,
and what the twin learns from it (``homepd.twin.calibration``).

The burst is the mixed trace's first requests (short chats and documents, the probes' own shapes) in a closed
loop of ``n_seq_max`` per entry worker: every decode batch size up to ``--n-seq-max`` appears, prompt slices of
every size the candidate's own step policy cuts, and the KV in use climbs to what documents and their neighbours
hold.  Each worker is fitted on its own steps, on its own placement (``worker_costs``).  The controller's template and tokenizer
are timed on the same prompts, and a disaggregated candidate's handoffs give the KV handoff's cost.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from homepd.core.protocol import StepRecord
from homepd.core.sampling import SamplingParams
from homepd.core.terms import RequestClass
from homepd.twin.calibration import (KV_FEATURE, Calibration, Reuse, StepCost, WorkerCalibration, cold_steps,
                                     handoff_of, narrow, prepare_cost, step_cost, warm_shapes, with_cold,
                                     with_own_speed)
from homepd.hw.monitor import other_cpu_cores
from homepd.core.modes import Mode, Role
from homepd.measure.metrics import SLO
from homepd.measure.replay import RunRecord, run_trace
from homepd.engine.topology import topology_for
from homepd.measure.trace import Trace, make_trace
from homepd.measure.trace.model import tagged

BURST_PER_SEQUENCE = 3        # requests per sequence id of each entry worker
MIN_BURST_REQUESTS = 8
N_PREPARE_SAMPLES = 6
# why: the burst is a closed loop, so its workers never idle, and a step after idleness runs longer
# (``homepd.twin.calibration.COLD_IDLE_MS``); a few short prompts one at a time after it, each after a pause,
# measure that (their steps price nothing else: run alone, they would skew a fit made beside the sibling worker)
N_COLD_PROMPTS = 3
COLD_PAUSE_S = 0.2
MIN_PROMPT_STEPS = 5          # a worker with fewer prompt steps takes another's cost per token
MIN_FITTED_STEPS = 20         # a worker with fewer steps in the burst takes a sibling's fit
# a colocated fixed chunk's burst request's output, as a share of the trace's ``max_tokens``: spread evenly over each
# round of the sequence ids, from the first to the second (their mean is the trace's)
# why: with every request the same length a closed loop decodes in full batches, and its last round ends at once;
# a fixed chunk of 256 then ran 81 of its 90 decode steps at 8 sequences and 4 at one, its fit's fixed part swung
# from 5 to 16 ms between two bursts, and a probe's single decodes ran at 0.60 of their price (its twin's TTFT p50
# 67-72 % over, three fidelity runs in a row); staggered, the last round drains through every batch size
# why not every candidate's: an adaptive budget cuts prompts into every size already (its fit's step shapes were
# within 0.87-1.17 unstaggered); a set of quick campaigns with every burst staggered had given lower capacities than
# the next, unstaggered set, but interleaved runs then showed no difference beyond the box's drift (2026-12-07:
# colocated-adaptive 0.92 and 1.41 req/s staggered, 0.92, 1.30 and two untrusted unstaggered): the others' bursts
# stay as they were, measured over many sessions, until a fidelity run says the stagger helps them
STAGGER = (0.25, 1.75)


def burst_size(n_seq_max: int, n_entry_workers: int, per_sequence: int = BURST_PER_SEQUENCE) -> int:
    """Requests in a burst: ``per_sequence`` rounds of every sequence id of every entry worker."""
    return max(MIN_BURST_REQUESTS, per_sequence * n_seq_max * n_entry_workers)


def burst_trace(config, per_sequence: int, *, max_tokens: int, long_tokens: int, seed: int) -> Trace:
    """The burst itself: the mixed trace's first ``burst_size`` requests, every sequence id of each entry worker
    busy at once (a closed loop); a colocated fixed chunk's outputs ``STAGGER``ed."""
    n_entry = topology_for(config.mode).n_entry_workers(config)
    width = config.n_seq_max * n_entry
    trace = make_trace("mixed", burst_size(config.n_seq_max, n_entry, per_sequence), 1.0, concurrency=width,
                       max_tokens=max_tokens, long_tokens=long_tokens, ignore_eos=True, seed=seed)
    if config.adaptive_chunk or Mode(config.mode) is not Mode.COLOCATED:
        return trace
    lo, hi = STAGGER
    share = lambda i: lo + (hi - lo) * (i % width) / max(1, width - 1)  # noqa: E731
    return replace(trace, requests=tuple(replace(r, max_tokens=max(1, round(max_tokens * share(i))))
                                         for i, r in enumerate(trace)))


async def calibrate(engine, candidate: str, trace: Trace, slo: SLO | None = None, sampler=None
                    ) -> tuple[Calibration, RunRecord]:
    """Run ``trace`` (a closed-loop burst: ``Trace.concurrency`` set) on the started ``engine``; its calibration
    and the run's record."""
    t0 = time.monotonic()
    record = await run_trace(engine, tagged(trace, "[calibration] "), trace_name="calibration", slo=slo,
                             sampler=sampler)
    t1 = time.monotonic()
    burst_s = t1 - t0
    busy_cores = other_cpu_cores(sampler.history(t0), t0, t1) if sampler is not None else None
    await _cold_prompts(engine, trace)
    every = engine.steps_since(t0)
    steps = [s for s in every if s.t_start_s < t1]
    specs = engine.worker_specs()
    cache = engine.cache_stats()
    own = {name: [s for s in steps if s.worker_role == name] for name in specs}
    costs = worker_costs(steps, list(specs), cold=[s for s in every if s.t_start_s >= t1])
    workers = tuple(WorkerCalibration(name, spec, costs[name], Reuse.of(cache.get(name), can_share=spec.kv_unified),
                                      warm=warm_shapes(own[name]))
                    for name, spec in specs.items())
    workers = tuple(_with_siblings(workers))
    samples = await asyncio.to_thread(_prepare_samples, engine, trace)
    base_ms, per_token_ms = prepare_cost(samples)
    prefill = specs.get(Role.PREFILL.value)
    cal = Calibration(candidate=candidate, workers=workers, prepare_base_ms=base_ms,
                      prepare_ms_per_token=per_token_ms, handoff=handoff_of(record.requests),
                      n_requests=len(record.requests), burst_s=burst_s,
                      kv_max=max((s.kv_in_use for s in steps), default=0),
                      prefill_n_ctx=prefill.n_ctx if prefill is not None else None,
                      other_cpu_cores=busy_cores, kv_feature=KV_FEATURE)
    return with_own_speed(cal, steps), record


def worker_costs(steps: list[StepRecord], names: list[str], cold: list[StepRecord] = ()) -> dict[str, StepCost]:
    """Each worker's step cost from the burst's ``steps`` (every worker's, in the order they ran), each fitted on its
    own steps, in two stages where its own cannot tell the terms apart:

    * a worker whose burst cannot tell its fixed part from its cost per token (``narrow``: a disaggregated prefill
      worker's few chunks of one size) takes the fixed part of the one whose burst can (the same llama.cpp loop on
      the same kind of core); its cost per token is its own;
    * a worker whose burst ran fewer than ``MIN_PROMPT_STEPS`` prompt steps (a disaggregated decode worker's burst
      is decodes only, so a prompt token and a decode token are one column to it: it priced a prompt token at 2 ms
      where its check's 17-token local prefills took 250 ms a step) takes the cost per token and a token's
      attention of the worker that ran most prompt steps, as that one runs alone, and fits its own fixed part,
      decode term and decode tokens' attention on what that leaves of its steps, then its contention as before.
      Its decode steps come out as its own fit put them (the fixed part and decode term absorb the difference).
      # why two stages: a joint least squares over both workers' steps priced the prompt steps right but pulled
      the decode steps 15 % up (the ridge shrinks the small decode feature), and its twin's capacity fell from the
      0.59-0.68 req/s its checks passed at to 0.32.

    ``cold``: steps run after the burst (``N_COLD_PROMPTS`` one at a time): those of them that followed idleness
    join the burst's own in measuring each worker's ``StepCost.cold_ms``; the rest price nothing.

    Not measured: a prefill worker's small prompt steps (the burst batches its prompts into 124-256-token steps).
    A trickle of short prompts one at a time after the burst measured them, but its steps ran alone where the
    burst's ran beside the sibling's, and it skewed the decode worker's fit (fixed part 18 -> 0 ms): contention
    must be regressed with the cost, not after it, before such steps can join."""
    own = {name: [s for s in steps if s.worker_role == name] for name in names}
    others = {name: [s for s in steps if s.worker_role != name] for name in names}
    costs = {name: step_cost(own[name], others[name]) for name in names}
    wide = [n for n in names if not narrow(own[n])]
    if wide:
        best = max(wide, key=lambda n: len(own[n]))
        for name in names:
            if name not in wide and own[name]:
                costs[name] = step_cost(own[name], others[name], base_ms=costs[best].coef[0])
    n_prompt = {name: sum(1 for s in own[name] if s.n_prompt_tokens > 0) for name in names}
    lender = max(names, key=lambda n: n_prompt[n], default=None)
    if lender is not None and n_prompt[lender] >= MIN_PROMPT_STEPS:
        for name in names:
            if n_prompt[name] < MIN_PROMPT_STEPS and own[name]:
                costs[name] = step_cost(own[name], others[name], token_terms=costs[lender].coef)
    for name in names:   # the steps after idleness: the burst's own (step_cost's) and the cold prompts'
        seq = own[name][-1:] + [s for s in cold if s.worker_role == name]
        extra = [seq[i] for i in cold_steps(seq)]
        if extra:
            costs[name] = with_cold(costs[name], [own[name][i] for i in cold_steps(own[name])] + extra,
                                    others[name] + [s for s in cold if s.worker_role != name])
    return costs


def _with_siblings(workers: tuple[WorkerCalibration, ...]):
    """A worker the burst gave too few steps to fit (replicas: the router sent every prompt where its prefix was)
    takes the step cost and cache of its best-measured sibling of the same role, placed alike on cores of its
    own."""
    for w in workers:
        if w.cost.n_steps >= MIN_FITTED_STEPS:
            yield w
            continue
        siblings = [o for o in workers if o.spec.role == w.spec.role and o.cost.n_steps >= MIN_FITTED_STEPS]
        best = max(siblings, key=lambda o: o.cost.n_steps, default=None)
        yield w if best is None else replace(w, cost=best.cost, reuse=best.reuse)


async def _cold_prompts(engine, trace: Trace) -> None:
    """``N_COLD_PROMPTS`` of the burst's own short prompts, tagged apart (their prefix cache is the burst's, not
    theirs), one at a time, each after ``COLD_PAUSE_S`` of idleness (what a prompt arriving at an idle worker
    meets); two tokens each."""
    short = [r for r in trace if r.request_class is not RequestClass.BACKGROUND][:N_COLD_PROMPTS]
    for req in tagged(replace(trace, requests=tuple(short)), "[calibration idle] "):
        await asyncio.sleep(COLD_PAUSE_S)   # why a sleep: the idleness is what is measured, not a wait for an event
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        stream = await (engine.submit(messages=list(req.messages), params=params, request_class=req.request_class)
                        if req.messages else engine.submit(req.prompt, params=params, request_class=req.request_class))
        await stream.collect()


def _prepare_samples(engine, trace: Trace) -> list[tuple[int, float]]:
    """(tokens, ms) of the controller's template and tokenizer on the burst's own prompts."""
    out = []
    for req in list(trace)[:N_PREPARE_SAMPLES]:
        t0 = time.perf_counter()
        ids = engine.prepare(req.prompt, messages=list(req.messages) if req.messages else None)
        out.append((len(ids), (time.perf_counter() - t0) * 1e3))
    return out
