"""The twin: a discrete-event simulation of one candidate, in virtual time, running homepd's own policy objects.

Nothing of the policy is written again here.  Each simulated worker holds the ``Scheduler`` its ``WorkerSpec``
gives a real worker (the step policy with its adaptive budget and deadline grant, the allocator, the KV policy,
the prefix cache with its pause rule), and its own ``OnlineStepModel`` that learns from the simulated steps as a
worker's learns from its real ones, so the budgets the policy gives follow what the simulated box does.  The
controller's side is the engine's: the mode's ``Topology.route_new`` (learned routing, the replica router), the
``AdmissionGate`` fed every simulated step (its estimates, routing and TTFT predictions), ``Lifecycle`` records
and the SLO's own checks.  A change to any of them changes the twin, with no change here.

What is the box's, not the policy's, comes from the candidate's ``Calibration``: each step's time (its worker's fit
plus a residual drawn from the measured ones), the loop's time between steps, the controller's template and
tokenizer (one request at a time, as its one thread runs them), the KV store's saves and restores per token, and
the KV handoff (export on the prefill worker before its next step, the relay, the import on the decode worker
before its next step).  Prompts are their real token ids, so the prefix cache finds what the real one finds.
Requests end at their ``max_tokens`` (benchmarks ignore the end of generation).
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

from homepd.twin.calibration import ALONE, BESIDE_DECODE, BESIDE_PROMPT, Calibration, Reuse, WorkerCalibration
from homepd.config import EngineConfig
from homepd.core.admission import Verdict
from homepd.core.kvpolicy import KVAction
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Role
from homepd.core.prefixreuse import store_is_faster
from homepd.core.protocol import StepRecord
from homepd.core.radix import common_length
from homepd.core.records import FinishReason, PrefixCacheStats
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler, StepPlan
from homepd.core.sequence import Sequence
from homepd.core.stepmodel import OnlineStepModel
from homepd.core.steppolicy import StepPolicy
from homepd.core.terms import RequestClass, ReuseMode
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import AdmissionGate, load_of
from homepd.engine.topology import topology_for
from homepd.kv.storeindex import StoreIndex

_ARRIVE, _ROUTE, _STEP_END, _WAKE, _HANDOFF = range(5)
# why: the store's per-token cost before one was measured (a save or restore is a memory copy: the order of a
# KV cell's bytes at memory bandwidth, ~0.2 ms/token here without flash attention)
UNMEASURED_STORE_MS_PER_TOKEN = 0.2
MIN_STORE_TOKENS = 64  # as the worker's store (homepd.worker.storekv): shorter prefixes are not saved
WARM_HANDOFF_TOKENS = 256  # the prompt length the warm gate's handoff cost per token is priced at


@dataclass(frozen=True)
class SimRequest:
    """One request as the twin sees it: when it arrives, its prompt's token ids, its output, its class."""
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    request_class: RequestClass = RequestClass.INTERACTIVE

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)


@dataclass
class SimRun:
    """A simulated run: every request's lifecycle (in arrival order) and the steps of every worker."""
    requests: list[Lifecycle]
    steps: list[StepRecord]
    end_s: float
    n_events: int = 0
    stopped: bool = False   # ended early by ``stop_when``: the requests not ended yet did not run to their end


class _KV:
    """The prefix cache's hands on a simulated context (``homepd.core.prefixreuse.KVOps``): cells move, no time."""

    def __init__(self, can_share: bool):
        self.can_share = can_share

    def drop(self, seq_id: int) -> None:
        pass

    def copy(self, src_id: int, dst_id: int, n_cells: int) -> int:
        return n_cells

    def trim(self, seq_id: int, n_keep: int) -> int | None:
        return n_keep


class _Store:
    """A simulated KV store tier (``homepd.core.prefixreuse.StoreOps``): the worker's own index
    (``homepd.kv.storeindex``), saves and restores that take their measured time (``busy_ms``), and the same
    choice of restore over prefill as the worker's (``store_is_faster``).  Capacity 0: no store attached (the
    worker's ``ContextStore`` without a segment: nothing saved, nothing found)."""

    def __init__(self, reuse: Reuse, bytes_per_token: int, estimate):
        self.capacity_bytes = reuse.store_capacity_bytes
        self.index = StoreIndex(reuse.store_capacity_bytes) if reuse.store_capacity_bytes else None
        self.save_ms_per_token = reuse.save_ms_per_token
        self.save_base_ms = reuse.save_base_ms if reuse.save_ms_per_token is not None else None
        self.restore_ms_per_token = reuse.restore_ms_per_token
        self._save_ms = reuse.save_ms_per_token or reuse.restore_ms_per_token or UNMEASURED_STORE_MS_PER_TOKEN
        self._restore_ms = reuse.restore_ms_per_token or self._save_ms
        self.bytes_per_token, self.estimate = bytes_per_token, estimate
        self.busy_ms = 0.0

    @property
    def n_entries(self) -> int:
        return len(self.index) if self.index is not None else 0

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes if self.index is not None else 0

    n_no_room = 0

    def save(self, seq_id: int, tokens) -> None:
        if self.index is None or len(tokens) < MIN_STORE_TOKENS or self.index.covers(tokens):
            return
        for old in self.index.superseded_by(tokens):
            self.index.remove(old)
        payload = len(tokens) * self.bytes_per_token
        if not self.index.can_ever_fit(payload):
            return
        placed = self.index.place(payload)
        if placed is None:
            return
        offset, extent, _ = placed
        self.index.insert(offset, extent, payload, tuple(tokens))
        self.busy_ms += (self.save_base_ms or 0.0) + self._save_ms * len(tokens)

    def lookup(self, prompt_ids, mode: ReuseMode, max_tokens: int):
        hit = self.peek(prompt_ids, mode, max_tokens)
        if hit is not None:
            self.index.touch(hit.entry)
        return hit

    def peek(self, prompt_ids, mode: ReuseMode, max_tokens: int):
        return self.index.longest_match(prompt_ids, mode, max_tokens) if self.index is not None else None

    def is_faster(self, hit, n_context_tokens: int) -> bool:
        return store_is_faster(len(hit.entry.tokens), hit.n_tokens - n_context_tokens, self._restore_ms,
                               self.estimate())

    def restore(self, hit, seq_id: int) -> int | None:
        if self.index.entry_at(hit.entry.offset) != hit.entry:
            return None
        self.busy_ms += self._restore_ms * len(hit.entry.tokens)
        self.index.touch(hit.entry)
        return hit.n_tokens


class _Worker:
    """One simulated worker: what a ``WorkerHandle`` shows the topology and the prefix affinity (``role``, ``spec``,
    ``failed``, ``ready``, ``in_flight``, ``cache_stats``' mode) and what its process holds (the scheduler, its step
    model, its store)."""

    def __init__(self, cal: WorkerCalibration, bytes_per_token: int, rng: random.Random):
        self.role, self.spec, self.cost = cal.name, cal.spec, cal.cost
        self.cache_stats = PrefixCacheStats(mode=ReuseMode(cal.reuse.mode))
        self.reuses = self.cache_stats.mode is not ReuseMode.OFF
        self.noise = cal.cost.start_noise(rng)  # the slow part of its step times (StepCost)
        self.failed, self.ready = None, True
        self.in_flight: set[str] = set()
        self.model = OnlineStepModel()
        spec, mode = self.spec, ReuseMode(cal.reuse.mode)
        self.store = _Store(cal.reuse, bytes_per_token, self.model.estimate)
        self.scheduler = Scheduler.of_spec(spec, spec.n_ctx, None if spec.kv_unified else spec.n_ctx // spec.n_ids,
                                           StepPolicy.of_spec(spec, self.model.estimate),
                                           kv_ops=_KV(cal.reuse.can_share), reuse_mode=mode,
                                           max_cached_cells=spec.max_cached_cells, store=self.store)
        self.busy = False           # a step or the loop's own time is running (a wake is queued)
        self.inbox: list[Sequence] = []
        self.exports: list[Sequence] = []   # prefill role: prompts done, their KV to export
        self.imports: list[Sequence] = []   # decode role: handoffs arrived, to import
        self.store_seen_ms = 0.0
        self.index = 0
        self.step_until = -1.0      # when its step in progress ends (contention: StepCost.contention)
        self.step_kind = ALONE      # what that step is to a worker beside it
        self.kv_range = 0           # its latest step's kv_in_use, as a ``WorkerHandle`` keeps it


class _Sim:
    def __init__(self, config: EngineConfig, cal: Calibration, seed: int, keep_steps: bool, stop_when=None):
        self.config, self.cal, self.keep_steps, self.stop_when = config, cal, keep_steps, stop_when
        self.stopped = False
        self.rng = random.Random(f"twin/{seed}")
        self.topology = topology_for(config.mode)
        self.workers = {w.name: _Worker(w, cal.kv_bytes_per_token, self.rng) for w in cal.workers}
        self.gate = AdmissionGate(config)
        self.affinity = PrefixAffinity()   # the controller's guess of what each worker holds (cache-aware routing)
        self.kv = _ArenaRoom(cal.prefill_n_ctx) if self.topology.uses_kv_arena else None
        self.events: list = []
        self.counter = itertools.count()
        self.lifecycles: dict[str, Lifecycle] = {}
        self.steps: list[StepRecord] = []
        self.n_events = 0
        self.tokenizer_free_s = 0.0   # the controller's one template-and-tokenizer thread
        self.warm()

    def warm(self) -> None:
        """The engine a probe runs on has run its burst (and earlier probes) first: its workers' step models
        are trusted, the gate knows each worker's speed and the handoff's cost.  Each simulated worker's model
        sees its burst's step shapes at their calibrated time (``WorkerCalibration.warm``), and the gate their
        estimates: the run starts warm, as the measurement does (cold, every prompt of a disaggregated twin's
        first seconds went to the prefill worker, whose speed the gate did not know yet)."""
        for wc in self.cal.workers:
            w = self.workers[wc.name]
            for shape in wc.warm:
                w.model.observe(*shape, w.cost.predict_ms(*shape))
            if wc.warm:
                self.gate.observe(w.role, StepRecord(worker_role=w.role, index=0, t_start_s=0.0, t_end_s=0.0,
                                                     decode_request_ids=(), prefill=()), w.model.estimate())
        handoff = self.cal.handoff
        if handoff.n_handoffs:
            n = WARM_HANDOFF_TOKENS
            self.gate.handoff_ms_per_token = (handoff.export_ms(n) + handoff.import_ms(n)) / n

    def warm_affinity(self, requests: list[SimRequest]) -> None:
        """The controller's affinity after the burst (``warm``): every worker that served it holds what all the
        probe's prompts share (the chat template's head: a probe's prompts are tagged apart from the burst's after
        it).  # why: started empty, the replica router sent every request of a mixed trace to the first replica
        to hold that head (a prefix hit on 30 shared tokens), and the twin put replicas-2 at 0.32 req/s where
        the measured probe met 100 % at 0.45 with the requests spread by load, as the warm controller spreads them"""
        if len(requests) < 2:
            return
        head = requests[0].prompt_ids
        for req in requests[1:]:
            head = head[:common_length(head, req.prompt_ids)]
            if not head:
                return
        for w in self.workers.values():
            if w.cost.n_steps and w.reuses:
                self.affinity.holds(w, head)

    def push(self, t: float, kind: int, *payload) -> None:
        heapq.heappush(self.events, (t, next(self.counter), kind, payload))

    def load(self, worker: _Worker):
        return load_of((self.lifecycles[rid] for rid in worker.in_flight),
                       worker.scheduler.allocator.n_cells_cached_only, worker.kv_range)

    # the controller ---------------------------------------------------------------------------------
    def arrive(self, t: float, i: int, req: SimRequest) -> None:
        """The controller takes it: its template and tokenizer run (one request at a time), then routing,
        admission and its worker's pipe."""
        rid = f"r{i}"
        self.lifecycles[rid] = Lifecycle(request_id=rid, arrived_s=t, n_prompt_tokens=req.n_prompt,
                                         request_class=req.request_class)
        self.tokenizer_free_s = max(t, self.tokenizer_free_s) + self.cal.prepare_ms(req.n_prompt) / 1e3
        self.push(self.tokenizer_free_s, _ROUTE, rid, req)

    def route(self, t: float, rid: str, req: SimRequest) -> None:
        lc = self.lifecycles[rid]
        routed = self.topology.route_new(self.config, self.workers, self.kv, self.gate, self.load, req.n_prompt,
                                         cached=lambda h: self.affinity.cached(h, req.prompt_ids),
                                         request_class=req.request_class)
        worker = routed.worker
        decision = self.gate.decide(req.request_class, req.n_prompt - routed.n_cached_tokens, worker.role,
                                    worker.spec, self.load(worker))
        if decision is not None and decision.verdict is Verdict.REJECT:
            lc.admission, lc.error = Verdict.REJECT.value, "rejected early (twin)"
            lc.advance(RequestState.FAILED, t)
            return
        self.gate.note_route(routed.reason)
        lc.routed_to, lc.route_reason = worker.role, routed.reason.value
        lc.route_cached_tokens = routed.n_cached_tokens
        if worker.reuses:
            self.affinity.holds(worker, req.prompt_ids)
        seq = Sequence(request_id=rid, prompt_ids=list(req.prompt_ids),
                       params=SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
                       request_class=req.request_class, deadline_s=self.gate.deadline_s(lc))
        worker.in_flight.add(rid)
        worker.inbox.append(seq)
        if not worker.busy:
            self.wake(t, worker)

    # a worker's loop ----------------------------------------------------------------------------------
    def wake(self, t: float, w: _Worker) -> None:
        """Its loop: the inbox, its role's pump (a handoff's export or import), the plan (with the KV store's
        saves and restores it makes), one step."""
        for seq in w.inbox:
            w.scheduler.add(seq)
        w.inbox.clear()
        pump_ms = self.pump(t, w)
        w.scheduler.policy.between_steps_ms = pump_ms
        t += pump_ms / 1e3
        plan = w.scheduler.schedule(t)
        for ev in plan.evicted:
            self.evicted(t, w, ev)
        idle_ms = (t - w.step_until) * 1e3   # since its last step ended: its loop, its pump, or idleness
        t += (w.store.busy_ms - w.store_seen_ms) / 1e3  # saves and restores run before the step
        w.store_seen_ms = w.store.busy_ms
        if plan.is_empty:
            w.busy = False
            return
        for seq in plan.reused:
            if not seq.n_pauses:
                self.lifecycles[seq.request_id].n_cached_tokens = seq.n_reused
        w.busy = True
        shape = (plan.n_prompt_tokens, plan.n_decode_tokens, plan.kv_in_use)
        beside = max((o.step_kind for o in self.workers.values() if o is not w and o.step_until > t), default=ALONE)
        step_ms = w.cost.draw_ms(self.rng, w.noise, *shape, beside=beside, idle_ms=idle_ms)
        w.model.observe(*shape, step_ms)
        w.step_until = t + step_ms / 1e3
        w.step_kind = BESIDE_PROMPT if plan.n_prompt_tokens else BESIDE_DECODE
        self.push(w.step_until, _STEP_END, w, plan, t)

    def evicted(self, t: float, w: _Worker, ev) -> None:
        """The full context took a request's cells (``homepd.core.kvpolicy``): re-queued, or ended."""
        lc = self.lifecycles[ev.seq.request_id]
        if ev.action is KVAction.PREEMPT:
            lc.n_kv_preemptions += 1
            lc.n_prefilled = 0
        else:
            self.end(t, w, ev.seq, FinishReason.LENGTH)
            lc.ended_by_kv_full = True

    def pump(self, t: float, w: _Worker) -> float:
        """The role's work before the plan, in ms: exports (prefill) or imports (decode), oldest first."""
        spent = 0.0
        handoff = self.cal.handoff
        for seq in w.exports:
            cost = handoff.export_ms(seq.n_kv_tokens)
            spent += cost
            self.lifecycles[seq.request_id].kv_export_s = cost / 1e3
            w.in_flight.discard(seq.request_id)
            w.scheduler.release(seq, keep_prefix=True)
            self.push(t + (spent + handoff.relay_ms) / 1e3, _HANDOFF, seq)
        w.exports.clear()
        while w.imports and w.scheduler.can_admit(w.imports[0]):
            seq = w.imports.pop(0)
            w.scheduler.admit(seq)
            cost = handoff.import_ms(seq.n_prompt)
            spent += cost
            lc = self.lifecycles[seq.request_id]
            lc.kv_import_s = cost / 1e3
            lc.transfer_end_s = t + spent / 1e3
            lc.advance(RequestState.DECODING, t + spent / 1e3)
        return spent

    def handoff(self, t: float, seq: Sequence) -> None:
        """A handoff reaches the decode worker: it imports it at its next pump (a sequence and cells free)."""
        decode = self.workers[Role.DECODE.value]
        moved = Sequence(request_id=seq.request_id, prompt_ids=seq.prompt_ids, params=seq.params,
                         n_prefilled=seq.n_prompt, output_ids=list(seq.output_ids), request_class=seq.request_class)
        decode.in_flight.add(seq.request_id)
        decode.imports.append(moved)
        if decode.reuses:
            self.affinity.holds(decode, seq.prompt_ids)  # its next turn is not prefilled anew
        if not decode.busy:
            self.wake(t, decode)

    def end(self, t: float, w: _Worker, seq: Sequence, reason: FinishReason) -> None:
        lc = self.lifecycles[seq.request_id]
        w.scheduler.release(seq, keep_prefix=True)
        w.in_flight.discard(seq.request_id)
        lc.finish_reason = reason
        lc.advance(RequestState.FINISHED, t)
        self.gate.finished(lc)
        if w.reuses:   # (a worker whose cache reuses nothing is never credited: nothing to keep for it)
            self.affinity.ended(w, lc, (*seq.prompt_ids, *seq.output_ids), self.workers)
        if self.stop_when is not None and self.stop_when(lc):
            self.stopped = True

    def step_end(self, t: float, w: _Worker, plan: StepPlan, t_start: float) -> None:
        w.index += 1
        # why the ids only when kept: the gate reads a step's budget, grant and wait, not who ran in it
        keep = self.keep_steps
        record = StepRecord(worker_role=w.role, index=w.index, t_start_s=t_start, t_end_s=t,
                            decode_request_ids=tuple(s.request_id for s in plan.decode) if keep else (),
                            prefill=tuple((sl.seq.request_id, sl.n_tokens) for sl in plan.prefill) if keep else (),
                            budget=plan.budget, kv_in_use=plan.kv_in_use,
                            granted_to=plan.grant.request_id if plan.grant is not None else None,
                            grant_lost=plan.grant is not None and plan.grant.lost, store_ms=plan.store_ms,
                            n_waiting_for_id=plan.n_waiting_for_id)
        if self.keep_steps:
            self.steps.append(record)
        self.gate.observe(w.role, record, w.model.estimate())
        w.kv_range = plan.kv_in_use
        for sl in plan.prefill:
            lc = self.lifecycles[sl.seq.request_id]
            if lc.state is RequestState.WAITING:
                lc.advance(RequestState.PREFILLING, t_start)
            lc.n_prefilled += sl.n_tokens
        sampled = dict.fromkeys([s.request_id for s in plan.decode] +
                                [sl.seq.request_id for sl in plan.prefill if sl.completes_prompt], 1)
        for seq in w.scheduler.postprocess(plan, sampled, t):
            lc = self.lifecycles[seq.request_id]
            lc.add_token(t)
            if len(lc.token_times_s) >= seq.params.max_tokens:
                self.end(t, w, seq, FinishReason.LENGTH)
            elif len(seq.output_ids) == 1 and lc.first_token_s == t:
                lc.prefill_end_s = t
                if w.spec.role is Role.PREFILL:
                    lc.advance(RequestState.TRANSFERRING, t)
                    w.exports.append(seq)
                else:
                    lc.advance(RequestState.DECODING, t)
        self.push(t + w.cost.draw_overhead_ms(self.rng) / 1e3, _WAKE, w)

    def run(self, requests: list[SimRequest]) -> SimRun:
        self.warm_affinity(requests)
        for i, req in enumerate(requests):
            self.push(req.arrival_s, _ARRIVE, i, req)
        t = 0.0
        while self.events and not self.stopped:
            t, _, kind, payload = heapq.heappop(self.events)
            self.n_events += 1
            if kind == _STEP_END:
                self.step_end(t, *payload)
            elif kind == _WAKE:
                self.wake(t, *payload)
            elif kind == _ARRIVE:
                self.arrive(t, *payload)
            elif kind == _ROUTE:
                self.route(t, *payload)
            else:
                self.handoff(t, *payload)
        return SimRun([self.lifecycles[f"r{i}"] for i in range(len(requests)) if f"r{i}" in self.lifecycles],
                      self.steps, t, self.n_events, stopped=self.stopped)


@dataclass
class _ArenaRoom:
    """The disaggregated topology's question of the KV arena: does a prompt fit the prefill worker's context."""
    prefill_n_ctx: int | None

    def fits_prefill_worker(self, n_prompt_tokens: int) -> bool:
        return self.prefill_n_ctx is None or n_prompt_tokens <= self.prefill_n_ctx


def simulate(config: EngineConfig, cal: Calibration, requests: list[SimRequest], seed: int = 0,
             keep_steps: bool = False, stop_when=None) -> SimRun:
    """Run ``requests`` (arrival offsets in seconds, in arrival order) through the candidate ``config`` calibrated
    as ``cal``; the same seed gives the same run.  ``keep_steps``: keep every simulated step (pictures);
    ``stop_when(lifecycle)``: asked as each request ends, True stops the run there (its outcome is decided)."""
    return _Sim(config, cal, seed, keep_steps, stop_when).run(sorted(requests, key=lambda r: r.arrival_s))
