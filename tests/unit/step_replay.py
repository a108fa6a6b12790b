"""A recorded run replayed through the real step policy: a small discrete-time simulator.

The recordings (``tests/data/steps-*.json``, from ``benchmarks/record_steps.py``) are real SmolLM2 runs of
the seeded mixed trace.  Here the requests arrive at the trace's offsets with the recorded prompt lengths
and classes; the real ``Scheduler`` + ``StepPolicy`` plan every step, a fresh ``OnlineStepModel`` learns
from the simulated steps exactly as a worker's does, and each step costs what the box costs: the
recording's own step-time regression (fitted over all its steps) plus the recording's residual of the
step with the same index, so the box's noise is replayed too.  No clock: simulated time only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from homepd.config import EngineConfig
from homepd.core.terms import RequestClass, StepEstimate
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.core.stepmodel import OnlineStepModel
from homepd.core.steppolicy import StepPolicy
from homepd.measure.trace import make_trace

DATA = Path(__file__).resolve().parent.parent / "data"
# what benchmarks/record_steps.py ran (its defaults; later recordings name them in their config): the trace
# is regenerated from these
TRACE_DEFAULTS = dict(requests=24, seed=0, max_tokens=48, long_tokens=470)
N_SEQ_MAX, N_CTX = 4, 16384


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def step_shape(step: dict) -> tuple[int, int, int]:
    return sum(n for _, n in step["prefill"]), len(step["decode"]), step["kv_in_use"]


BUDGETS = EngineConfig().class_budgets  # the engine's default class budgets


@dataclass(frozen=True)
class RecordedCost:
    """What a step costs on the recorded box: the regression over the recording's steps + its residuals."""
    fit: StepEstimate
    residuals_ms: tuple[float, ...]

    @classmethod
    def from_recording(cls, rec: dict, role: str = "colocated") -> "RecordedCost":
        steps = [s for s in rec["steps"] if s["role"] == role]
        model = OnlineStepModel(forget=1.0)  # why: no forgetting = ordinary least squares over the whole run
        for s in steps:
            model.observe(*step_shape(s), s["duration_ms"])
        fit = model.estimate()
        return cls(fit, tuple(s["duration_ms"] - fit.predict_ms(*step_shape(s)) for s in steps))

    def step_ms(self, index: int, n_prompt: int, n_decode: int, kv_in_use: int) -> float:
        noise = self.residuals_ms[index % len(self.residuals_ms)]
        return max(0.1, self.fit.predict_ms(n_prompt, n_decode, kv_in_use) + noise)


@dataclass
class SimStep:
    t_start_s: float
    duration_ms: float
    decode: tuple[str, ...]
    prefill: tuple[tuple[str, int], ...]
    budget: int                           # the prompt-token budget the policy gave the step
    waiting_interactive: tuple[str, ...]  # interactive prompts arrived and not yet fully prefilled


@dataclass
class SimRequest:
    request_id: str
    request_class: str
    arrival_s: float
    n_prompt: int
    max_tokens: int
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s


@dataclass
class SimRun:
    steps: list[SimStep]
    requests: dict[str, SimRequest]
    itl_budget_ms: float

    def interactive_ids(self) -> set[str]:
        return {r.request_id for r in self.requests.values() if r.request_class == RequestClass.INTERACTIVE}

    def over_budget_share(self) -> float:
        """Share of the steps carrying an interactive stream's token that took longer than the ITL budget."""
        ids = self.interactive_ids()
        carrying = [s for s in self.steps if ids.intersection(s.decode)]
        return sum(s.duration_ms > self.itl_budget_ms for s in carrying) / len(carrying)

    def worst_gap_ms(self) -> float:
        """The longest wait of any interactive stream between two of its tokens."""
        return max((b - a) * 1e3 for r in self.requests.values() if r.request_class == RequestClass.INTERACTIVE
                   for a, b in zip(r.token_times_s, r.token_times_s[1:]))

    def class_order_violations(self) -> list[SimStep]:
        """Steps whose first prompt slice went to a background prompt while an interactive one waited."""
        ids = self.interactive_ids()
        return [s for s in self.steps if s.waiting_interactive and s.prefill and s.prefill[0][0] not in ids]


def requests_of(rec: dict) -> list[SimRequest]:
    """The recorded requests at the offsets of the trace that produced them."""
    c = {**TRACE_DEFAULTS, **rec["config"]}
    trace = make_trace("mixed", c["requests"], c["rate"], max_tokens=c["max_tokens"], long_tokens=c["long_tokens"],
                       seed=c["seed"])
    recorded = rec["requests"]
    assert [r["request_class"] for r in recorded] == [t.request_class for t in trace], "not this trace"
    return [SimRequest(r["request_id"], r["request_class"], t.arrival_s, r["n_prompt_tokens"], t.max_tokens)
            for r, t in zip(recorded, trace)]


def simulate(rec: dict, cost: RecordedCost, *, chunk: int, adaptive: bool) -> SimRun:
    """Run the recorded requests through a colocated worker's scheduler and step policy."""
    itl_budget_ms = rec["config"]["itl_budget_ms"]
    n_batch = max(min(chunk, N_CTX), N_SEQ_MAX)  # as WorkerSpec.n_batch
    step_model = OnlineStepModel()
    policy = StepPolicy(chunk, n_batch, itl_budget_ms if adaptive else None, estimate=step_model.estimate)
    scheduler = Scheduler(n_seq_max=N_SEQ_MAX, n_ctx=N_CTX, n_batch=n_batch, chunk=chunk, policy=policy)
    arrivals = sorted(requests_of(rec), key=lambda r: r.arrival_s)
    requests = {r.request_id: r for r in arrivals}
    steps: list[SimStep] = []
    now_s, pending = 0.0, list(arrivals)
    while pending or scheduler.has_work:
        while pending and pending[0].arrival_s <= now_s:
            r = pending.pop(0)
            ttft_ms = BUDGETS[RequestClass(r.request_class)].ttft_ms
            scheduler.add(Sequence(request_id=r.request_id, prompt_ids=[1] * r.n_prompt,
                                   params=SamplingParams(max_tokens=r.max_tokens), request_class=r.request_class,
                                   deadline_s=r.arrival_s + ttft_ms / 1e3))
        if not scheduler.has_work:
            now_s = pending[0].arrival_s
            continue
        waiting = tuple(s.request_id for s in (*scheduler.running, *scheduler.waiting)
                        if s.is_prefilling and s.request_class == RequestClass.INTERACTIVE)
        plan = scheduler.schedule(now_s)
        shape = (plan.n_prompt_tokens, plan.n_decode_tokens, plan.kv_in_use)
        # why not the plan's kv_in_use: the recordings' steps were fitted on the cells the running sequences held
        # (the step's own prompt tokens in), not on the cache's used range the scheduler now prices with
        held = sum(s.n_kv_tokens for s in scheduler.running) + plan.n_prompt_tokens
        duration_ms = cost.step_ms(len(steps), plan.n_prompt_tokens, plan.n_decode_tokens, held)
        step_model.observe(*shape, duration_ms)
        steps.append(SimStep(now_s, duration_ms, tuple(s.request_id for s in plan.decode),
                             tuple((sl.seq.request_id, sl.n_tokens) for sl in plan.prefill), plan.budget, waiting))
        now_s += duration_ms / 1e3
        sampled = {s.request_id: 1 for s in (*plan.decode, *(sl.seq for sl in plan.prefill))}
        for seq in scheduler.postprocess(plan, sampled):
            requests[seq.request_id].token_times_s.append(now_s)
            if len(seq.output_ids) >= requests[seq.request_id].max_tokens:
                scheduler.release(seq)
    return SimRun(steps, requests, itl_budget_ms)
