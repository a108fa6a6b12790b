"""The controller's side of two queues, two budgets: it measures, predicts, admits and routes.

Every worker publishes its online step-time model's estimate with each step (``StepReport.estimate``: the
model its own step policy budgets with); the gate keeps the latest one.  From it and what is queued, ``decide`` predicts a new request's TTFT on the worker it
would enter and applies the pure admission policy (``homepd.core.admission``); ``route`` chooses, in
disaggregated mode, between prefilling on the decode worker and the prefill worker + KV handoff from the
measured speeds, handoff cost and queue depth.  It counts every decision and keeps the prediction errors,
so the snapshot (and ``/metrics``, the app, run records) show what it did and how well it predicted.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

from homepd.config import EngineConfig
from homepd.core.admission import Decision, QueueState, RouteState, Verdict, admit, predict_ttft_ms, route
from homepd.core.terms import RequestClass, StepEstimate
from homepd.core.lifecycle import Lifecycle
from homepd.core.modes import Role
from homepd.core.protocol import StepRecord, WorkerSpec
from homepd.core.records import AdmissionSnapshot, ClassQueue
from homepd.core.routing import RouteReason
from homepd.stats import percentile
from homepd.cellmap import attended_cells
from homepd.core.steppolicy import StepPolicy

MIN_PROMPT_STEPS = 4      # steps with prompt tokens a worker must have run before its prefill speed is trusted
MAX_ERRORS = 2000


@dataclass(frozen=True)
class WorkerLoad:
    """What one worker holds, as the controller sees it."""
    queued_tokens: dict[RequestClass, int]   # prompt tokens not yet prefilled, per class
    queued_requests: dict[RequestClass, int]
    n_decode: int
    n_interactive_decode: int
    kv_in_use: int = 0   # KV cells its running requests hold
    n_seqs: int = 0      # its running requests (those holding KV)
    idle_cells: int = 0  # KV cells only its cached prefixes hold (its latest ``PrefixCacheStats.n_cached_cells``)
    kv_range: int = 0    # the cells its latest step attended over (``StepRecord.kv_in_use``), as its scheduler priced it

    def kv_attended(self, spec: WorkerSpec) -> int:
        """What each token of the worker's next step attends over, as its own scheduler prices it: on a unified cache
        without flash attention its used range (holes included: ``homepd.cellmap``), which its latest step reported,
        and at least the cells counted (``cellmap.attended_cells``, which is all there is elsewhere)."""
        counted = attended_cells(self.kv_in_use, self.n_seqs, streams=not spec.kv_unified, idle_cells=self.idle_cells,
                                 flash_attn=spec.flash_attn)
        return max(counted, self.kv_range) if spec.kv_unified and not spec.flash_attn else counted


def load_of(lifecycles: Iterable[Lifecycle], idle_cells: int = 0, kv_range: int = 0) -> WorkerLoad:
    """What these running requests (a worker's, or all) hold: prompt tokens still to prefill and requests
    waiting for a first token, per class, and the decoding streams; ``idle_cells``: the worker's cached prefixes'
    own cells; ``kv_range``: its cache's used range (``WorkerLoad.kv_range``)."""
    tokens: Counter = Counter()
    queued: Counter = Counter()
    n_decode = n_interactive = kv_in_use = n_seqs = 0
    for lc in lifecycles:
        klass = RequestClass(lc.request_class)
        if lc.first_token_s is None:
            tokens[klass] += max(0, lc.n_prompt_tokens - lc.n_prefilled)
            queued[klass] += 1
            kv_in_use += lc.n_prefilled
            n_seqs += lc.n_prefilled > 0  # a prompt still queued holds no KV yet
        else:
            n_seqs += 1
            n_decode += 1
            n_interactive += klass is RequestClass.INTERACTIVE
            kv_in_use += lc.n_prompt_tokens + len(lc.token_times_s) - 1
    return WorkerLoad(dict(tokens), dict(queued), n_decode, n_interactive, kv_in_use, n_seqs, idle_cells, kv_range)


class AdmissionGate:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.budgets = config.class_budgets
        # each worker's latest trusted estimate (None: not yet), in the order the workers first stepped
        self.estimates: dict[str, StepEstimate | None] = {}
        self.last_budget: dict[str, int] = {}
        self.deadline_grants: dict[str, int] = {}  # steps granted past the ITL budget to a TTFT deadline
        self.lost_grants: dict[str, int] = {}  # steps at the gap ceiling for a prompt whose deadline was lost
        # prompt-seconds waited while every sequence id was held, over the steps' own time: a lower bound (what runs
        # between two steps is not counted; on a real model that is a few ms a step, on the fake backend most)
        self.id_wait_s: dict[str, float] = {}
        self.counts: dict[RequestClass, Counter[str]] = {c: Counter() for c in RequestClass}
        self.errors_ms: deque[float] = deque(maxlen=MAX_ERRORS)
        self.handoff_ms_per_token: float | None = None
        self.routed: Counter[str] = Counter()
        self.route_threshold: int | None = None
        self.route_reasons: Counter[RouteReason] = Counter()
        self.route_predicted_cached_tokens = 0  # ended requests: cached tokens routing expected ...
        self.route_reused_tokens = 0            # ... and what their workers reported reusing (PrefixReused)

    # measurements -------------------------------------------------------------
    def observe(self, worker: str, step: StepRecord, estimate: StepEstimate | None) -> None:
        """A step of ``worker`` and the estimate it published after it."""
        # why: a worker that restarts publishes a fresh model, untrusted for its first steps; until it is
        # trusted its predecessor's (same cores, same model) is the better guess.  Without restarts the
        # published counts only grow, so this is simply the latest estimate once trusted.
        if estimate is not None and estimate.n_prompt_steps >= MIN_PROMPT_STEPS:
            self.estimates[worker] = estimate
        else:
            self.estimates.setdefault(worker, None)
        if step.budget:
            self.last_budget[worker] = step.budget
        # a series per worker from its first step, at 0 until something happens (a counter's absence is not a 0)
        self.deadline_grants.setdefault(worker, 0)
        self.lost_grants.setdefault(worker, 0)
        if step.granted_to is not None:
            (self.lost_grants if step.grant_lost else self.deadline_grants)[worker] += 1
        self.id_wait_s[worker] = self.id_wait_s.get(worker, 0.0) + step.n_waiting_for_id * step.duration_ms / 1e3

    def estimate(self, worker: str) -> StepEstimate | None:
        """The worker's published step-time estimate, once its model has seen enough steps with prompt tokens
        to price them."""
        return self.estimates.get(worker)

    def prefill_rate(self, worker: str, spec: WorkerSpec, n_decode: int, n_interactive_decode: int,
                     kv_in_use: int = 0) -> tuple[float, float] | None:
        """(prompt tokens/s, ms of the rest of a step) on ``worker`` beside ``n_decode`` decodes, at the
        budget its own step policy would give (``StepPolicy.of_spec``: the ITL-safe one when interactive streams
        decode and the chunk adapts)."""
        est = self.estimate(worker)
        if est is None:
            return None
        per_step = max(1, StepPolicy.of_spec(spec, lambda: est).budget_for(n_decode, n_interactive_decode, kv_in_use))
        return est.prefill_tok_s(n_decode, per_step), est.predict_ms(0, n_decode)

    def finished(self, lc: Lifecycle) -> None:
        """A request ended: keep its TTFT prediction error and what its KV handoff cost per token."""
        if lc.predicted_ttft_s is not None and lc.ttft_s is not None:
            self.errors_ms.append((lc.ttft_s - lc.predicted_ttft_s) * 1e3)
        if lc.kv_export_s is not None and lc.kv_import_s is not None and lc.n_prompt_tokens:
            per = (lc.kv_export_s + lc.kv_import_s) * 1e3 / lc.n_prompt_tokens
            self.handoff_ms_per_token = per if self.handoff_ms_per_token is None else \
                0.8 * self.handoff_ms_per_token + 0.2 * per
        if lc.route_cached_tokens:
            self.route_predicted_cached_tokens += lc.route_cached_tokens
            self.route_reused_tokens += lc.n_cached_tokens

    # decisions -----------------------------------------------------------------
    def deadline_s(self, lc: Lifecycle) -> float:
        """When the request's first token is due (the monotonic clock): arrival plus its class's TTFT budget."""
        return lc.arrived_s + self.budgets[RequestClass(lc.request_class)].ttft_ms / 1e3

    def decide(self, klass: RequestClass, n_prompt: int, worker: str, spec: WorkerSpec, load: WorkerLoad
               ) -> Decision | None:
        """Admission's verdict for a new request entering ``worker``; None while the worker's speed is unmeasured
        (then it is admitted: there is nothing to predict from)."""
        rate = self.prefill_rate(worker, spec, load.n_decode, load.n_interactive_decode, load.kv_attended(spec))
        if rate is None:
            self.counts[klass]["admitted"] += 1
            return None
        tok_s, step_ms = rate
        q = QueueState(queued_interactive_tokens=load.queued_tokens.get(RequestClass.INTERACTIVE, 0),
                       queued_background_tokens=load.queued_tokens.get(RequestClass.BACKGROUND, 0),
                       prefill_tok_s=tok_s, step_overhead_ms=step_ms)
        decision = admit(klass, n_prompt, q, self.budgets)
        if decision.verdict is Verdict.REJECT and not self.config.admission:
            decision = Decision(Verdict.ADMIT, decision.predicted_ttft_ms, decision.budget_ms)
        self.counts[klass]["rejected" if decision.verdict is Verdict.REJECT else "admitted"] += 1
        if decision.verdict is Verdict.DEFER:
            self.counts[klass]["deferred"] += 1
        return decision

    def predicted_ttft_ms(self, klass: RequestClass, n_uncached: int, worker: str, spec: WorkerSpec,
                          load: WorkerLoad) -> float | None:
        """``decide``'s TTFT prediction for ``n_uncached`` prompt tokens to compute on ``worker``, without a
        verdict or a count (routing compares workers with it); None while the worker's speed is unmeasured."""
        rate = self.prefill_rate(worker, spec, load.n_decode, load.n_interactive_decode, load.kv_attended(spec))
        if rate is None:
            return None
        q = QueueState(queued_interactive_tokens=load.queued_tokens.get(RequestClass.INTERACTIVE, 0),
                       queued_background_tokens=load.queued_tokens.get(RequestClass.BACKGROUND, 0),
                       prefill_tok_s=rate[0], step_overhead_ms=rate[1])
        return predict_ttft_ms(klass, n_uncached, q)

    def note_route(self, reason: RouteReason) -> None:
        """A new request was routed, for ``reason`` (the snapshot counts them)."""
        self.route_reasons[reason] += 1

    def route(self, n_prompt: int, prefill: WorkerSpec, prefill_load: WorkerLoad, decode: WorkerSpec,
              decode_load: WorkerLoad, cached_local_tokens: int = 0, cached_remote_tokens: int = 0) -> bool:
        """True: prefill this prompt on the decode worker itself; False: on the prefill worker, then hand off.
        ``cached_*_tokens``: of this prompt, probably held by the decode / the prefill worker (not computed).

        Until the prefill worker's speed is measured every prompt goes there.  The decode worker's prefill
        speed is its own measurement once it has prefilled a few prompts, else the prefill worker's scaled
        by their thread counts."""
        remote = self.prefill_rate(Role.PREFILL, prefill, 0, 0)
        if remote is None:
            self.routed["remote"] += 1
            return False
        local = self.prefill_rate(Role.DECODE, decode, decode_load.n_decode, decode_load.n_interactive_decode,
                                  decode_load.kv_attended(decode))
        local_tok_s = local[0] if local is not None else remote[0] * decode.n_threads / max(prefill.n_threads, 1) \
            * 0.5  # why: beside its decodes it gets about half its time for prompts until measured
        decision = route(n_prompt, RouteState(
            prefill_queue_tokens=sum(prefill_load.queued_tokens.values()), prefill_tok_s_prefill=remote[0],
            prefill_tok_s_decode=local_tok_s, handoff_ms_per_token=self.handoff_ms_per_token or 0.0,
            handoff_base_ms=remote[1], max_local_tokens=self.local_prefill_limit(decode, decode_load),
            cached_local_tokens=cached_local_tokens, cached_remote_tokens=cached_remote_tokens))
        self.route_threshold = decision.threshold_tokens
        self.routed["local" if decision.on_decode_worker else "remote"] += 1
        return decision.on_decode_worker

    def local_prefill_limit(self, decode: WorkerSpec, decode_load: WorkerLoad) -> int:
        """The longest prompt the decode worker may prefill itself now: what one step of its policy may carry
        beside its running decodes within their ITL budget (``prompt_budget``: the whole batch when no
        interactive stream decodes; the smallest chunk while its speed is unmeasured).  A longer prompt there
        would hold those streams for several steps: the interference disaggregation exists to remove."""
        est = self.estimate(Role.DECODE)
        budget = StepPolicy.of_spec(decode, lambda: est).budget_for(
            decode_load.n_decode, decode_load.n_interactive_decode, decode_load.kv_attended(decode))
        return max(0, budget)

    # what it did ------------------------------------------------------------------
    def snapshot(self, load: WorkerLoad, running_by_class: dict[str, int]) -> AdmissionSnapshot:
        """``load``: what every running request holds; ``running_by_class``: running requests per class value."""
        classes = tuple(ClassQueue(
            request_class=c, queued_requests=load.queued_requests.get(c, 0),
            queued_prompt_tokens=load.queued_tokens.get(c, 0), running=running_by_class.get(c.value, 0),
            admitted=self.counts[c]["admitted"], deferred=self.counts[c]["deferred"],
            rejected=self.counts[c]["rejected"], ttft_budget_ms=self.budgets[c].ttft_ms,
            itl_budget_ms=self.budgets[c].itl_ms) for c in RequestClass)
        rates = {}
        for worker, est in self.estimates.items():
            if est is not None:
                chunk = self.last_budget.get(worker) or self.config.chunk or 256
                rates[worker] = round(est.prefill_tok_s(0, chunk), 1)
        errors = [abs(e) for e in self.errors_ms]
        return AdmissionSnapshot(
            classes=classes, chunk_by_worker=dict(self.last_budget), prefill_tok_s_by_worker=rates,
            admission=self.config.admission, adaptive_chunk=self.config.adaptive_chunk,
            ttft_error_mean_ms=sum(errors) / len(errors) if errors else None,
            ttft_error_p90_ms=percentile(errors, 90),
            n_predictions=len(errors), routed_local=self.routed["local"], routed_remote=self.routed["remote"],
            route_threshold_tokens=self.route_threshold,
            routed_by_reason={r.value: n for r, n in sorted(self.route_reasons.items())},
            route_predicted_cached_tokens=self.route_predicted_cached_tokens,
            route_reused_tokens=self.route_reused_tokens, deadline_grants_by_worker=dict(self.deadline_grants),
            lost_grants_by_worker=dict(self.lost_grants), id_wait_s_by_worker=dict(self.id_wait_s))
