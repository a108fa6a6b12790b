"""Colocated step policy: stall-free batching with bounded prefill chunks (Sarathi-Serve).

Pure policy: no llama_cpp, no pipes, no clock.  Every step first takes one decode token for every running sequence
that has finished its prompt, then fills the rest of the token budget (``chunk``) with the next slices of waiting
prompts, oldest first.  ``chunk=None`` is the unchunked baseline: whole prompts in one step, bounded only by the
batch size.  Which sequence ids and KV cells are free is the allocator's business (``homepd.core.allocator``); how
many cells a request reserves, when it grows and who gives cells back when the context is full is
``homepd.core.kvpolicy``'s, applied here: a plan lists the requests it took cells from (``StepPlan.evicted``) for
the worker to act on.  With a prefix cache (``homepd.core.prefixreuse``) a finished sequence's KV stays cached, an
admitted prompt starts from the longest cached prefix (``StepPlan.reused``), and cached entries are evicted before
any running request gives cells back.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from homepd.core import kvpolicy
from homepd.core.terms import RequestClass, ReuseMode
from homepd.core.allocator import KVAllocator
from homepd.core.kvpolicy import KVAction
from homepd.core.prefixreuse import KVOps, PrefixReuse, StoreOps
from homepd.core.sequence import Sequence
from homepd.cellmap import attended_cells
from homepd.core.steppolicy import DeadlineGrant, StepPolicy, gap_keepers

# why: a paused prefill's KV goes to the KV store only from 64 tokens (storekv.MIN_STORE_TOKENS); less is recomputed
MIN_PAUSED_TOKENS = 64


@dataclass(frozen=True)
class PrefillSlice:
    seq: Sequence
    start: int
    stop: int

    @property
    def n_tokens(self) -> int:
        return self.stop - self.start

    @property
    def completes_prompt(self) -> bool:
        return self.stop == self.seq.n_prompt


@dataclass(frozen=True)
class Eviction:
    """A running request whose cells the full context took back before this step (``homepd.core.kvpolicy``):
    the worker drops the KV of ``seq_id`` and preempts it (re-queued) or ends it with 'length'."""
    seq: Sequence
    seq_id: int
    action: KVAction


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[Sequence, ...]
    prefill: tuple[PrefillSlice, ...]
    budget: int = 0  # the prompt-token budget the policy gave this step
    # KV cells each token attends over once this step's prompt tokens are in (``attended_cells``): every running
    # sequence's and every idle cached prefix's on a unified cache, the running ones' mean with streams
    kv_in_use: int = 0
    evicted: tuple[Eviction, ...] = ()  # applied by the worker before the step (also when it is empty)
    reused: tuple[Sequence, ...] = ()  # admitted this step from a cached prefix (``Sequence.n_reused`` tokens)
    grant: DeadlineGrant | None = None  # the step is past the ITL budget for this prompt's TTFT deadline
    paused: tuple[Sequence, ...] = ()  # prefills that gave their sequence id to a prompt ahead (KV kept, cached)
    store_ms: float = 0.0  # the KV store's saves and restores since the last plan: the streams wait for them too
    n_waiting_for_id: int = 0  # prompts left waiting while every sequence id was held (--n-seq-max running)

    @property
    def n_decode_tokens(self) -> int:
        return len(self.decode)

    @property
    def n_prompt_tokens(self) -> int:
        return sum(s.n_tokens for s in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns the waiting queue and the running set; admits through a ``KVAllocator``."""

    def __init__(self, n_seq_max: int, n_ctx: int, n_batch: int, chunk: int | None, decodes: bool = True,
                 policy: StepPolicy | None = None, kv_ops: KVOps | None = None,
                 reuse_mode: ReuseMode = ReuseMode.OFF, max_cached_cells: int = 0, store: StoreOps | None = None,
                 n_cached_ids: int = 0, stream_cells: int | None = None, n_prefill_ids: int = 0,
                 flash_attn: bool = False):
        assert n_seq_max >= 1 and n_ctx >= 1 and n_batch >= n_seq_max
        assert chunk is None or chunk >= 1
        self.n_batch = n_batch
        self.policy = policy or StepPolicy(chunk, n_batch)  # the chunk lives in the policy
        self.decodes = decodes  # False for a prefill-only worker: finished prompts wait for hand-off
        # stream_cells: each id's own stream (--kv-layout streams), None: one unified pool
        self.allocator = KVAllocator(n_seq_max=n_seq_max, n_ctx=n_ctx, n_cached_ids=n_cached_ids,
                                     stream_cells=stream_cells, n_prefill_ids=n_prefill_ids)
        # None: no prefix cache (off, or the context cannot keep a finished sequence)
        self.prefixes = PrefixReuse(self.allocator, kv_ops, ReuseMode(reuse_mode), max_cached_cells, store) \
            if kv_ops is not None and reuse_mode != ReuseMode.OFF and max_cached_cells > 0 else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self._store_ms_seen = 0.0  # the KV store's busy time the budget has counted so far (StoreOps.busy_ms)
        self._store_ms_at_step = 0.0  # ... and when the last step was planned (what ran since, streams wait for)
        self.flash_attn = flash_attn  # its context's: whether a step pays for idle cached cells (``attended_cells``)

    @classmethod
    def of_spec(cls, spec, n_ctx: int, stream_cells: int | None, policy: StepPolicy, **reuse) -> "Scheduler":
        """A worker's (and its twin's) on ``spec``, a ``WorkerSpec``; ``reuse``: the prefix cache's arguments."""
        return cls(spec.n_seq_max, n_ctx, spec.n_batch, spec.chunk, spec.decodes, policy,
                   n_cached_ids=spec.n_cached_ids, stream_cells=stream_cells, n_prefill_ids=spec.n_prefill_ids,
                   flash_attn=spec.flash_attn, **reuse)

    # queue management ---------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._note_arrival(seq)
        # why: a follow-up turn whose history is cached is a short job; counted as its whole prompt, the
        # deadline order set it behind a long late prompt (a RAG follow-up waited 1.4 s for another document)
        seq.n_expected_reuse = self.prefixes.expected_reuse(seq) if self.prefixes is not None else 0
        self.waiting.append(seq)

    def _note_arrival(self, seq: Sequence) -> None:
        if seq.arrival_order is None:
            seq.arrival_order = next(self._arrivals)

    def cells_needed(self, seq: Sequence) -> int:
        """KV cells seq reserves when admitted (``kvpolicy.cells_to_admit``); it grows as it decodes."""
        return kvpolicy.cells_to_admit(seq, self.decodes)

    def can_admit(self, seq: Sequence) -> bool:
        """A sequence id is free and seq's cells fit, leaving a block of headroom per running decode."""
        # why no headroom with streams: the running decodes grow in their own streams, not in this one's
        headroom = kvpolicy.admission_headroom(len(self.running)) if self.decodes and not self.streams else 0
        # why evicting: cached prefixes are reclaimable, they never keep a request waiting
        return self.allocator.can_allocate_evicting(self.cells_needed(seq) + headroom)

    def admit(self, seq: Sequence, restore_limit_ms: float | None = None) -> bool:
        """Give seq a sequence id and reserve the cells its next steps need: a waiting prompt takes the
        cached entry matching it longest, if any (then returns True), else cached entries are evicted as
        far as its id and cells need.  ``restore_limit_ms``: the longest KV store restore it may make now."""
        self._note_arrival(seq)
        n_cells = self.cells_needed(seq)
        reused = self.prefixes is not None and seq.n_prefilled == 0 and self.prefixes.take(seq, n_cells,
                                                                                            restore_limit_ms)
        if not reused:
            if self.prefixes is not None:
                self.prefixes.make_room(n_cells)
            seq.seq_id = self.allocator.allocate(n_cells)
        self.running.append(seq)
        return reused

    def release(self, seq: Sequence, keep_prefix: bool = False) -> bool:
        """Take seq out (finished, cancelled or handed off); its sequence id and cells become free, or, with
        ``keep_prefix`` and a prefix cache, its KV stays cached under its id.  True: it was kept (the caller
        must not drop its KV)."""
        kept = False
        if seq in self.running:
            self.running.remove(seq)
            if keep_prefix and self.prefixes is not None and self.prefixes.store is not None:
                # the streams left, not the one ending, wait for what keeping its prefix saves
                self.prefixes.save_limit_ms = self._less_store_spent(self.policy.store_room_ms(*self._decoding()))
            kept = keep_prefix and self.prefixes is not None and self.prefixes.keep(seq)
            if not kept:
                self.allocator.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.is_finished = True
        return kept

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def streams(self) -> bool:
        """Each id has its own stream of the KV cache (``--kv-layout streams``)."""
        return self.allocator.stream_cells is not None

    def _attended(self, n_decode: int, n_prompt: int = 0) -> int:
        """What each token of a step of ``n_decode`` decodes and ``n_prompt`` prompt tokens attends over: without
        flash attention on a unified cache, the cache's used range once they are placed (``homepd.cellmap``); else
        the running sequences' cells with the prompt tokens in, as ``attended_cells`` counts them."""
        cells = self.allocator.cells
        if cells is not None and not self.flash_attn:
            return cells.attended(n_decode + n_prompt)
        return attended_cells(sum(s.n_kv_tokens for s in self.running) + n_prompt, len(self.running), self.streams,
                              self.allocator.n_cells_cached_only, self.flash_attn)

    def _place_imports(self) -> None:
        """Running sequences whose KV came whole since the last step (the KV store's restore, a hand-off) take
        their cells as llama.cpp imports a sequence (``state_read_meta``: as a batch of its tokens)."""
        cells = self.allocator.cells
        for seq in self.running:
            missing = seq.n_kv_tokens - cells.n_of(seq.seq_id)
            if missing > 0:
                cells.place([(seq.seq_id, missing)])

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # the policy ------------------------------------------------------------
    def schedule(self, now_s: float = 0.0) -> StepPlan:
        """Decide the next step's composition; admits waiting requests as room allows.

        The policy gives the prompt budget and the order prompts are served in (``now_s``: the clock its
        deadlines are on); a waiting prompt that does not fit the KV yet holds the ones after it (no starving).
        First every decode gets the cell its token needs, by the policy of ``homepd.core.kvpolicy``.  Only here,
        where prompts start, may more than ``n_seq_max`` run (the allocator's ``n_prefill_ids``).
        # why: a document waited for an id held by chats whose steps left budget unused (docs/scheduling.md)"""
        self.allocator.n_run_limit = self.allocator.n_seq_max + self.allocator.n_prefill_ids
        try:
            return self._schedule(now_s)
        finally:
            self.allocator.n_run_limit = self.allocator.n_seq_max

    def _schedule(self, now_s: float) -> StepPlan:
        if self.allocator.cells is not None:
            self._place_imports()
        evicted = self._reserve_decode_cells() if self.decodes else ()
        decode, kv_in_use = self._decoding()
        budget = self.policy.budget(decode, kv_in_use)
        if self.prefixes is not None and self.prefixes.store is not None:
            self.prefixes.save_limit_ms = self._less_store_spent(self.policy.store_room_ms(decode, kv_in_use))
        prefilling = [s for s in self.running if s.is_prefilling]
        if prefilling or self.waiting:
            # why: a prompt always advances, even when decodes fill the chunk
            budget = max(budget, 1)
        ordered = self.policy.order([*prefilling, *self.waiting], now_s, len(decode), kv_in_use, budget,
                                    n_gap_keepers=gap_keepers(decode))
        paused = self._pause_for(ordered)
        grant = self.policy.grant(ordered, decode, now_s, budget, kv_in_use) if ordered and self.decodes else None
        itl_budget = budget
        if grant is not None:
            budget = grant.budget
        store_ms_before = self._store_ms_seen
        budget = self._less_store_time(budget, kv_in_use)  # saves and restores since the last step
        planned = budget
        slices: list[PrefillSlice] = []
        reused: list[Sequence] = []
        blocked = False  # a waiting prompt did not fit: the waiting ones after it wait too (no starving it)
        for seq in ordered:
            if budget <= 0:
                break
            if seq.seq_id is None:  # waiting: admit it if its KV fits, else it (and all waiting after it) wait
                if blocked or evicted or not self.can_admit(seq):
                    # why not stop: a prompt already admitted after it in the order would idle for nothing (a
                    # document's prefill stood still for 0.9 s while a chat turn waited for a sequence id)
                    blocked = True
                    if grant is not None and seq.request_id == grant.request_id:
                        # the prompt the step was granted to waits: the others get what the ITL budget gave
                        used, planned = planned - budget, min(planned, itl_budget)
                        budget, grant = planned - used, None
                    continue
                self.waiting.remove(seq)
                limit = self._less_store_spent(self.policy.restore_limit_ms(seq, decode, now_s, kv_in_use)) \
                    if self.prefixes is not None and self.prefixes.store is not None else None
                if self.admit(seq, limit):
                    reused.append(seq)
                budget = self._less_store_time(budget, kv_in_use)  # what its admission saved or restored
            slices.append(self._slice(seq, budget))
            budget -= slices[-1].n_tokens
            if slices[-1].completes_prompt and seq.request_class != RequestClass.BACKGROUND:
                # why: its first token waits for the whole step; the prompts after it get what an ITL share
                # holds (a RAG follow-up shared its step with 500 ms of another document)
                tail = self.policy.after_first_token(kv_in_use)
                budget = budget if tail is None else min(budget, tail)
        # why count them: the ids, not the budget, are what a document waited for among chats (docs/scheduling.md);
        # /metrics and the app name that wait, and raising --n-seq-max is its remedy
        n_waiting_for_id = 0 if self.allocator.id_available else len(self.waiting)
        if self.prefixes is not None and self.prefixes.store is not None:
            self._store_ms_at_step = self.prefixes.store.busy_ms
        return StepPlan(decode=decode, prefill=tuple(slices), budget=planned,
                        kv_in_use=self._attended(len(decode), sum(sl.n_tokens for sl in slices)),
                        evicted=evicted, reused=tuple(reused), paused=paused,
                        store_ms=self._store_ms_seen - store_ms_before, n_waiting_for_id=n_waiting_for_id,
                        grant=grant if grant is not None and any(sl.seq.request_id == grant.request_id for sl in slices)
                        else None)

    def _decoding(self) -> tuple[tuple[Sequence, ...], int]:
        """The running sequences that decode in the next step, and the KV cells each token of it attends over."""
        decode = tuple(s for s in self.running if not s.is_prefilling) if self.decodes else ()
        return decode, self._attended(len(decode))

    def _less_store_spent(self, limit_ms: float | None) -> float | None:
        """``limit_ms`` (what the streams can wait for before the next step; None: no limit) less what the KV store did
        since the last step was planned: between two steps they add up in one gap (docs/scheduling.md)."""
        return None if limit_ms is None else max(0.0, limit_ms - (self.prefixes.store.busy_ms - self._store_ms_at_step))

    def _less_store_time(self, budget: int, kv_in_use: int) -> int:
        """``budget`` less the prompt tokens the KV store's saves and restores since the last call would have
        computed; a prompt still advances.  # why: the streams wait for them as for a step (a 150 ms save before a
        170 ms ceiling step had made a 340 ms gap)"""
        store = self.prefixes.store if self.prefixes is not None else None
        if store is None or store.busy_ms <= self._store_ms_seen:
            return budget
        spent_ms, self._store_ms_seen = store.busy_ms - self._store_ms_seen, store.busy_ms
        return max(min(budget, 1), budget - self.policy.tokens_in_ms(spent_ms, kv_in_use))

    def _pause_for(self, ordered: list[Sequence]) -> tuple[Sequence, ...]:
        """A prompt waiting for a sequence id while one served after it holds one: the latter's prefill pauses.

        Its KV stays as a cached prefix of its own prompt (saved to the KV store if evicted), and it waits
        again expecting to take those tokens back, so nothing is recomputed.  Only with a KV store (without
        one an evicted pause would be lost work), only for a prompt set behind an interactive one that needs
        just an id (its cells fit), and only for a paused part long enough to be stored."""
        if self.prefixes is None or self.prefixes.store is None or not self.decodes:
            return ()
        if self.allocator.id_available:
            return ()  # another sequence may run, under an id free or reclaimable: nobody needs to give one back
        blocked = next((s for s in ordered if s.seq_id is None), None)
        if blocked is None or blocked.request_class == RequestClass.BACKGROUND:
            return ()
        after = ordered[ordered.index(blocked) + 1:]
        victim = next((s for s in reversed(after) if s.seq_id is not None and s.is_prefilling
                       and s.n_prefilled >= MIN_PAUSED_TOKENS), None)
        if victim is None:
            return ()
        headroom = kvpolicy.admission_headroom(len(self.running) - 1)
        if self.allocator.n_cells_reserved - self.allocator.n_cells_of(victim.seq_id) + self.cells_needed(blocked) \
                + headroom > self.allocator.n_ctx:
            return ()  # it waits for cells too: pausing would not let it in
        if not self.prefixes.pause(victim):
            return ()
        self.running.remove(victim)
        victim.pause()
        self.waiting.append(victim)
        return (victim,)

    def _reserve_decode_cells(self) -> tuple[Eviction, ...]:
        """Grow the reservation of every decode whose next token needs a cell, oldest first; when the
        context is full, take cells back from the victims the policy names until it fits."""
        # why only those whose next token outgrows their cells, sorted only then: nearly every step needs no cell
        # (reservations grow a block at a time), and the twin runs this per simulated step
        n_cells_of = self.allocator.n_cells_of
        growing = [s for s in self.running
                   if not s.is_prefilling and kvpolicy.cells_to_grow(s, n_cells_of(s.seq_id)) is not None]
        if not growing:
            return ()
        evicted: list[Eviction] = []
        for seq in sorted(growing, key=lambda s: s.arrival_order):
            while seq.seq_id is not None:
                grow = kvpolicy.cells_to_grow(seq, self.allocator.n_cells_of(seq.seq_id))
                if grow is None:
                    break
                wanted, least = grow
                fits = next((n for n in (wanted, least) if self.allocator.can_grow(seq.seq_id, n)), None)
                if fits is not None:
                    self.allocator.grow(seq.seq_id, fits)
                    break
                if self.prefixes is not None and self.prefixes.evict_lru():
                    continue  # a cached prefix gives its cells back before any running request
                # why: a request alone always fits (its worst case is capped to n_ctx), so a victim exists
                evicted.append(self._evict(kvpolicy.victim_order(self.running)[0]))
        return tuple(evicted)

    def _evict(self, seq: Sequence) -> Eviction:
        """Take seq's cells back: preempted (front of the waiting queue, recomputed later) or finished."""
        eviction = Eviction(seq=seq, seq_id=seq.seq_id, action=kvpolicy.action_for(seq))
        self.running.remove(seq)
        self.allocator.free(seq.seq_id)
        if eviction.action is KVAction.PREEMPT:
            seq.restart_for_recompute()
            seq.n_preemptions += 1
            self.waiting.appendleft(seq)
        else:
            seq.seq_id = None
            seq.is_finished = True
        return eviction

    @staticmethod
    def _slice(seq: Sequence, budget: int) -> PrefillSlice:
        stop = min(seq.n_prompt, seq.n_prefilled + budget)
        return PrefillSlice(seq=seq, start=seq.n_prefilled, stop=stop)

    def postprocess(self, plan: StepPlan, sampled: dict[str, int], t_s: float | None = None) -> list[Sequence]:
        """Apply a finished step: advance prompts, append sampled tokens (keyed by request id); ``t_s``: when
        the step ended, which marks a stream whose gap went over the ITL budget (``Sequence.gap_broken``).

        Returns the sequences that received a new token this step.
        """
        if self.allocator.cells is not None:  # the batch's order: the decodes, then the prompt slices
            self.allocator.cells.place([*((s.seq_id, 1) for s in plan.decode if s.seq_id is not None),
                                        *((sl.seq.seq_id, sl.n_tokens) for sl in plan.prefill
                                          if sl.seq.seq_id is not None)])
        got_token: list[Sequence] = []
        for seq in plan.decode:
            seq.output_ids.append(sampled[seq.request_id])
            got_token.append(seq)
        for sl in plan.prefill:
            sl.seq.n_prefilled = sl.stop
            if sl.completes_prompt:
                sl.seq.output_ids.append(sampled[sl.seq.request_id])
                got_token.append(sl.seq)
        if t_s is not None:
            itl_s = None if self.policy.itl_budget_ms is None else self.policy.itl_budget_ms / 1e3
            for seq in got_token:
                if itl_s is not None and seq.last_token_s is not None and t_s - seq.last_token_s > itl_s:
                    seq.gap_broken = True
                seq.last_token_s = t_s
        return got_token
