"""A worker process: owns one model + context and runs its own step loop.

The loop is nano-vllm's three lines: schedule, run, postprocess.  The role
(``homepd.worker.roles``) decides what a request does when its prompt is
done: ``colocated`` keeps decoding it here; the ``prefill`` and ``decode``
roles (disaggregation) plug in through ``Role`` hooks without changing the
loop.  A request's sampler and text stream live on its ``Sequence``.
"""
from __future__ import annotations

import os
import select
import time
import traceback

from homepd.backends import model_classes
from homepd.core import modes
from homepd.core.kvpolicy import KVAction
from homepd.core.terms import ReuseMode
from homepd.core.protocol import CacheSource, KVPreempted, PrefixReused
from homepd.core.records import PrefixCacheStats
from homepd.core.protocol import (AttachStore, WorkerSpec, CancelRequest, Heartbeat, RequestDone, Shutdown, StepRecord, StepReport,
                             CachedPrefixesSaved, SaveCachedPrefixes, SubmitRequest, TokenOut, WorkerFatal, WorkerReady, wire_fingerprint)
from homepd.core.sampling import TokenLogprob, top_logprobs
from homepd.core.scheduler import Scheduler, StepPlan
from homepd.core.records import FinishReason
from homepd.core.sequence import Sequence
from homepd.core.stepmodel import OnlineStepModel
from homepd.core.steppolicy import StepPolicy
from homepd.chat.textstream import TextStream
from homepd.hw.smaps import anon_intervals, new_intervals, resident_bytes
from homepd.worker.prefixkv import ContextKV
from homepd.worker.roles import Role, make_role
from homepd.worker.storekv import ContextStore


def worker_main(spec: WorkerSpec, conn) -> None:
    """Run a worker on ``conn`` until told to stop or the controller is gone.

    CUDA_VISIBLE_DEVICES is already set by the spawner (it must be, before
    llama.cpp initialises its CUDA backend).
    """
    if spec.cpu_cores:
        os.sched_setaffinity(0, spec.cpu_cores)
    try:
        t0 = time.monotonic()
        model_cls, context_cls = model_classes(spec.backend)
        before_model = anon_intervals()
        model = model_cls(spec.model_path, n_gpu_layers=spec.offload_layers)
        after_model = anon_intervals()
        ctx = context_cls(model, n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_seq_max=spec.n_ids,
                           n_threads=spec.n_threads, kv_unified=spec.kv_unified, flash_attn=spec.flash_attn)
        # what llama.cpp allocated for the model and the context; the context's resident part now is its KV cache
        regions = tuple(("model", a, b) for a, b in new_intervals(before_model, after_model)) + \
            tuple(("context", a, b) for a, b in new_intervals(after_model, anon_intervals()))
        kv_cache_bytes = resident_bytes("self", [(a, b) for kind, a, b in regions if kind == "context"])
        per_token, overhead = measure_state_bytes(ctx, model) if spec.role != modes.Role.COLOCATED else (0, 0)
        loop = WorkerLoop(spec, model, ctx, conn, kv_bytes_per_cell=kv_cache_bytes // max(1, ctx.n_ctx))
        prefixes = loop.scheduler.prefixes
        conn.send(WorkerReady(pid=os.getpid(), role=spec.role, model_size_bytes=model.size_bytes,
                              n_ctx=ctx.n_ctx, load_s=time.monotonic() - t0,
                              state_bytes_per_token=per_token, state_overhead_bytes=overhead,
                              memory_regions=regions, kv_cache_bytes=kv_cache_bytes,
                              prefix_cache_mode=prefixes.mode if prefixes else ReuseMode.OFF,
                              wire=wire_fingerprint()))
        try:
            loop.run()
        except (EOFError, BrokenPipeError):
            loop.running, loop.controller_gone = False, True
        if loop.controller_gone:
            loop.abandon()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # report, then die: the controller restarts us
        try:
            conn.send(WorkerFatal(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except Exception:
            pass
        raise SystemExit(1)


def measure_state_bytes(ctx, model) -> tuple[int, int]:
    """KV state bytes per token and fixed overhead, from a 1- and a 2-token sequence."""
    token = model.bos_id if model.bos_id >= 0 else 0
    ctx.decode([token], [0], [0], [False])
    one = ctx.state_size(0)
    ctx.decode([token], [1], [0], [False])
    two = ctx.state_size(0)
    ctx.seq_rm(0)
    return two - one, one - (two - one)


class WorkerLoop:
    """Executes the scheduler's plans on one context and reports every step; its role does the rest."""

    def __init__(self, spec: WorkerSpec, model, ctx, conn, kv_bytes_per_cell: int = 0):
        self.spec, self.model, self.ctx, self.conn = spec, model, ctx, conn
        self.kv_bytes_per_cell = kv_bytes_per_cell  # the prefix cache's bytes in its stats
        # the worker's own step-time model, fitted online from its steps: the adaptive budget and the
        # deadline order read it every step
        self.step_model = OnlineStepModel()
        policy = StepPolicy.of_spec(spec, self.step_model.estimate)
        # the KV store tier: its segment comes with the controller's AttachStore (none: no store)
        self.store = ContextStore(ctx, conn.send, spec.model_fingerprint, self.step_model.estimate,
                                  fault=spec.fault)
        self.scheduler = Scheduler.of_spec(spec, ctx.n_ctx, None if spec.kv_unified else ctx.n_ctx_seq, policy,
                                           kv_ops=ContextKV(ctx, spec.fault), reuse_mode=ctx.reuse_mode,
                                           # why: that fault stands in for the cache; a real reuse would blur its claims
                                           max_cached_cells=0 if spec.fault == "claim_prefix_hits"
                                           else spec.max_cached_cells, store=self.store)
        self.role: Role = make_role(spec, ctx, self.scheduler, conn.send, self.finish)
        self.parent_pid = os.getppid()
        # why: Connection.poll builds a selector per call; a poll object is ~1 us
        self._inbox = select.poll()
        self._inbox.register(conn.fileno(), select.POLLIN)
        self.n_steps = 0
        self._logprobs: dict[str, TokenLogprob] = {}  # this step's, by request, until emitted
        self.running = True
        self.controller_gone = False

    # inbox ------------------------------------------------------------------
    def run(self) -> None:
        idle = True
        while self.running:
            self.drain_inbox(block=idle)
            if not self.running:
                break
            t_pump = time.monotonic()
            self.role.pump()
            now = time.monotonic()
            # why: a decoding stream also waits for what runs between steps (a KV import); the next step's
            # budget leaves room for it
            self.scheduler.policy.between_steps_ms = (now - t_pump) * 1e3
            plan = self.scheduler.schedule(now)
            idle = plan.is_empty and not plan.evicted
            if not idle:
                self.step(plan)

    def drain_inbox(self, block: bool) -> None:
        while block and not self._inbox.poll(500):
            if os.getppid() != self.parent_pid:  # controller gone: never outlive it
                self.running, self.controller_gone = False, True
                return
            if self.scheduler.has_work or self.role.has_work:
                self.conn.send(Heartbeat(time.monotonic()))  # idle but holding requests: not hung
        while self.running and self._inbox.poll(0):
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.running, self.controller_gone = False, True
                return
            self.handle(msg)

    def abandon(self) -> None:
        """The controller died: leave nothing behind (the KV arena's extents and the store included)."""
        self.role.abandon()
        self.store.abandon()

    def handle(self, msg) -> None:
        if isinstance(msg, SubmitRequest):
            try:
                sampler = self.ctx.new_sampler(msg.params, msg.history_ids)
            except Exception as exc:  # the controller checked it; a refusal here fails this request alone
                self.conn.send(RequestDone(msg.request_id, FinishReason.ERROR, time.monotonic(), error=f"sampler: {exc}"))
                return
            self.scheduler.add(Sequence(
                request_id=msg.request_id, prompt_ids=list(msg.prompt_ids), params=msg.params, sampler=sampler,
                stream=msg.stream if msg.stream is not None else TextStream(msg.params.stop),
                request_class=msg.request_class, deadline_s=msg.deadline_s))
        elif isinstance(msg, CancelRequest):
            seq = self.scheduler.find(msg.request_id)
            if seq is not None:
                self.role.forget(seq)
                self.finish(seq, keep_prefix=True)
                self.conn.send(RequestDone(msg.request_id, FinishReason.CANCELLED, time.monotonic()))
            else:
                self.role.cancel(msg.request_id)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, AttachStore):
            self.store.attach(msg)
        elif isinstance(msg, SaveCachedPrefixes):
            prefixes = self.scheduler.prefixes
            self.conn.send(CachedPrefixesSaved(prefixes.save_all() if prefixes is not None else 0))
        elif not self.role.handle(msg):
            raise AssertionError(f"unknown message {msg!r}")

    def apply_evictions(self, plan: StepPlan) -> None:
        """Before the step: drop the KV of every request the full context took cells from; a preempted one
        waits to be recomputed here, an ended one is done with 'length' (``homepd.core.kvpolicy``)."""
        now = time.monotonic()
        for ev in plan.evicted:
            self.ctx.seq_rm(ev.seq_id)
            if ev.action is KVAction.PREEMPT:
                self.conn.send(KVPreempted(ev.seq.request_id, now, ev.seq.n_prompt))
            else:
                self.role.forget(ev.seq)
                self.conn.send(RequestDone(ev.seq.request_id, FinishReason.LENGTH, now, text=ev.seq.stream.flush(), kv_full=True))

    # one step -----------------------------------------------------------------
    def step(self, plan: StepPlan) -> None:
        """Run one planned step: one llama_decode, sampling, and one report to the controller (first the
        plan's evictions, which may be all it holds)."""
        self.apply_evictions(plan)
        if plan.is_empty:
            return
        tokens, positions, seq_ids, wants, logit_rows = self._batch(plan)
        started = tuple(sl.seq.request_id for sl in plan.prefill if sl.start == sl.seq.n_reused)
        claimed = self._claim_prefix_hits(plan) if self.spec.fault == "claim_prefix_hits" else None
        t_start = time.monotonic()
        for seq in plan.reused:
            if seq.n_pauses:
                continue  # it takes back its own paused prefill: what it was served from a cache is already said
            self.conn.send(PrefixReused(seq.request_id, seq.n_reused,
                                        CacheSource.STORE if seq.is_restored else CacheSource.CONTEXT, t_start))
        try:
            self.ctx.decode(tokens, positions, seq_ids, wants)
        except Exception as exc:  # e.g. no KV slot: fail the step's requests, keep the worker
            for seq in [*plan.decode, *(sl.seq for sl in plan.prefill)]:
                self.finish(seq)
                self.conn.send(RequestDone(seq.request_id, FinishReason.ERROR, time.monotonic(), error=str(exc)))
            return
        shape = (plan.n_prompt_tokens, plan.n_decode_tokens, plan.kv_in_use)
        plan, sampled = self._sample(plan, logit_rows)
        t_end = time.monotonic()
        self.step_model.observe(*shape, (t_end - t_start) * 1e3)  # what a decoding stream waits: decode + sampling
        got_token = self.scheduler.postprocess(plan, sampled, t_end)
        self.n_steps += 1
        record = StepRecord(
            worker_role=self.spec.role, index=self.n_steps, t_start_s=t_start, t_end_s=t_end,
            decode_request_ids=tuple(s.request_id for s in plan.decode),
            prefill=tuple((sl.seq.request_id, sl.n_tokens) for sl in plan.prefill), budget=plan.budget,
            kv_in_use=plan.kv_in_use, granted_to=plan.grant.request_id if plan.grant is not None else None,
            grant_lost=plan.grant is not None and plan.grant.lost, store_ms=plan.store_ms,
            n_waiting_for_id=plan.n_waiting_for_id)
        outs, done = [], []
        for seq in got_token:
            out, fin = self.emit(seq, t_end)
            if out is not None:
                outs.append(out)
            if fin is not None:
                done.append(fin)
        self._logprobs.clear()
        self.conn.send(StepReport(
            step=record, prefill_started=started,
            prefill_ended=tuple(sl.seq.request_id for sl in plan.prefill if sl.completes_prompt),
            tokens=tuple(outs), done=tuple(done), estimate=self.step_model.estimate(),
            cache=claimed if claimed is not None else
            self.scheduler.prefixes.stats(self.kv_bytes_per_cell) if self.scheduler.prefixes else None))

    def _batch(self, plan: StepPlan):
        """The step's batch: decode tokens first, then prompt slices; logit_rows pairs every sequence
        that gets a token this step with its logits row (decodes, then prompts that complete)."""
        tokens, positions, seq_ids, wants = [], [], [], []
        logit_rows: list[tuple[Sequence, int]] = []
        for i, seq in enumerate(plan.decode):
            logit_rows.append((seq, i))
            tokens.append(self._decode_token(plan, i))
            positions.append(seq.next_decode_pos)
            seq_ids.append(seq.seq_id)
            wants.append(True)
        for sl in plan.prefill:
            tokens.extend(sl.seq.prompt_ids[sl.start:sl.stop])
            positions.extend(range(sl.start, sl.stop))
            seq_ids.extend([sl.seq.seq_id] * sl.n_tokens)
            wants.extend([False] * sl.n_tokens)
            if sl.completes_prompt:
                wants[-1] = True
                logit_rows.append((sl.seq, len(tokens) - 1))
        return tokens, positions, seq_ids, wants, logit_rows

    def _sample(self, plan: StepPlan, logit_rows: list[tuple[Sequence, int]]) -> tuple[StepPlan, dict[str, int]]:
        """Sample every sequence that has logits; one that fails (e.g. NaN logits) fails alone.

        Returns the plan without the failed sequences, and request id -> token.
        """
        sampled: dict[str, int] = {}
        failed = []
        for seq, row in logit_rows:
            try:
                # why: log-probabilities are of the model's distribution, so read before the sampler's bias
                raw = self.ctx.logits(row).copy() if seq.params.n_logprobs is not None else None
                token = sampled[seq.request_id] = seq.sampler.sample(row)
                if raw is not None:
                    self._logprobs[seq.request_id] = self._logprob(raw, token, seq.params.n_logprobs)
            except Exception as exc:
                failed.append((seq, f"sampling failed: {exc}"))
        if not failed:
            return plan, sampled
        for seq, error in failed:
            self.finish(seq)
            self.conn.send(RequestDone(seq.request_id, FinishReason.ERROR, time.monotonic(), error=error))
        return StepPlan(decode=tuple(q for q in plan.decode if q.request_id in sampled),
                        prefill=tuple(sl for sl in plan.prefill
                                      if not sl.completes_prompt or sl.seq.request_id in sampled),
                        budget=plan.budget, kv_in_use=plan.kv_in_use, grant=plan.grant), sampled

    def _logprob(self, logits, token: int, k: int) -> TokenLogprob:
        lp, top = top_logprobs(logits, token, k)
        piece = self.model.token_to_piece
        return TokenLogprob(token, piece(token), lp, tuple((t, piece(t), v) for t, v in top))

    def emit(self, seq: Sequence, t_s: float) -> tuple[TokenOut | None, RequestDone | None]:
        """Turn seq's newest token into an output event; decide whether seq is finished."""
        token = seq.output_ids[-1]
        stream = seq.stream
        if self.model.is_eog(token) and not seq.params.ignore_eos:
            self._logprobs.pop(seq.request_id, None)
            return None, self._done(seq, FinishReason.STOP, t_s, stream.flush())
        text = stream.feed(self.model.token_to_piece(token))
        out = TokenOut(seq.request_id, token, text, t_s, self._logprobs.pop(seq.request_id, None))
        if stream.stopped:
            return out, self._done(seq, FinishReason.STOP, t_s, "")
        if len(seq.output_ids) >= seq.params.max_tokens:
            return out, self._done(seq, FinishReason.LENGTH, t_s, stream.flush())
        if len(seq.output_ids) == 1:
            self.role.prompt_done(seq, t_s)
        return out, None

    def _done(self, seq: Sequence, reason: FinishReason, t_s: float, text: str) -> RequestDone:
        self.finish(seq, keep_prefix=True)
        return RequestDone(seq.request_id, reason, t_s, text=text)

    def finish(self, seq: Sequence, keep_prefix: bool = False) -> None:
        """Seq leaves this worker (done, cancelled, failed or handed off): free its KV and sequence id, or,
        with ``keep_prefix`` (it left normally) and a prefix cache, keep its KV as a cached prefix."""
        holds_kv = seq.seq_id is not None and not seq.is_finished and seq in self.scheduler.running
        seq_id = seq.seq_id
        if not self.scheduler.release(seq, keep_prefix=keep_prefix) and holds_kv:
            self.ctx.seq_rm(seq_id)

    # test-only fault injection: deliberate scheduling bugs ----------------------
    def _claim_prefix_hits(self, plan: StepPlan) -> PrefixCacheStats:
        """'claim_prefix_hits': report half of each new prompt as reused (nothing is reused), so the faces'
        cache figures can be tested end to end on the fake backend."""
        n = getattr(self, "_claimed", (0, 0, 0))
        for sl in plan.prefill:
            if sl.start == 0:
                hit = sl.seq.n_prompt // 2
                self.conn.send(PrefixReused(sl.seq.request_id, hit, CacheSource.CONTEXT, time.monotonic()))
                n = (n[0] + 1, n[1] + sl.seq.n_prompt, n[2] + hit)
        self._claimed = n
        return PrefixCacheStats(n_lookups=n[0], n_hits=n[0], n_lookup_tokens=n[1], n_hit_tokens=n[2],
                                n_cached_entries=1, n_cached_cells=16, cached_bytes=16 << 10, mode=ReuseMode.PREFIX)

    def _decode_token(self, plan: StepPlan, i: int) -> int:
        seq = plan.decode[i]
        if self.spec.fault == "stale_token" and len(seq.output_ids) >= 2:
            return seq.output_ids[-2]  # feeds the previous token again: duplicated, newest dropped
        if self.spec.fault == "swap_seq" and len(plan.decode) >= 2:
            return plan.decode[(i + 1) % len(plan.decode)].output_ids[-1]  # another sequence's token
        return seq.output_ids[-1]

