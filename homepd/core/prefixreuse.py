"""Prefix reuse inside a worker: the policy over the prefix index, the allocator and the context's KV.

Pure policy (no llama_cpp, no clock); the scheduler calls it, and it acts on the context only through
``KVOps``, which the worker gives (``homepd.llm`` or ``homepd.fakellm`` behind it):

* **keep**: a sequence leaving the worker normally (finished, cancelled, handed off) keeps its KV under
  its sequence id as a cached entry (``homepd.core.prefixcache``); an identical older entry is dropped.
* **take**: a request being admitted reuses the entry sharing the longest prefix of its prompt — at most
  all but its last token, which must be computed for its logits — and prefills only the remainder (a
  partial match shorter than ``MIN_PARTIAL_MATCH_TOKENS`` is not worth it).  An
  entry the prompt wholly continues (a conversation's next turn) becomes the request's: its id and cells.
  Of an entry matched only in part (a shared document, a system prompt), the request gets a copy of the
  matched cells under a new id (``KVOps.copy``: shared cells, nothing copied on a unified cache), so the
  entry stays for its own next turn; where the context cannot share (``KVOps.can_share`` False) or no id
  is free, the request takes the entry and drops its tail (``KVOps.trim``).  If the context refuses to
  drop the tail (``trim`` is None), the entry is dropped whole and the prompt prefilled from its start.
* **evict**: least recently used first, whenever a request needs a sequence id or cells that cached
  entries hold, and whenever the entries hold more than ``max_cached_cells`` (a budget: idle cached cells
  cost every running step on a unified KV cache, ``benchmarks/kv_layout.py``).  Finished sequences' entries
  share the ``n_seq_max`` running ids' places with the running requests; only paused prefills hold the
  allocator's ids beyond them (``_slot_room``).
* **store** (optional, ``StoreOps``: the host-memory KV store tier, ``homepd.kv.store``): an entry evicted for
  room is saved there first; a prompt whose longest match in the store is longer than in the context is
  restored from it (and only the rest prefilled) when ``store_is_faster`` says so.
"""
from __future__ import annotations

from typing import Protocol

from homepd.core.terms import ReuseMode, StepEstimate

from homepd.core.allocator import KVAllocator
from homepd.core.prefixcache import PrefixIndex
from homepd.core.records import PrefixCacheStats
from homepd.core.sequence import Sequence


# why 16: a partial match under a KV block (a BOS, a role tag) saves little, and would drop someone's conversation
MIN_PARTIAL_MATCH_TOKENS = 16


class KVOps(Protocol):
    def drop(self, seq_id: int) -> None:
        """Remove every cell of ``seq_id`` from the context."""

    can_share: bool  # copy() shares cells (a unified cache); else only whole-sequence copies exist

    def copy(self, src_id: int, dst_id: int, n_cells: int) -> int:
        """Give empty ``dst_id`` the first ``n_cells`` positions of ``src_id`` (shared cells); returns the
        positions it got."""

    def trim(self, seq_id: int, n_keep: int) -> int | None:
        """Keep positions ``0..n_keep-1`` of ``seq_id``, drop the rest; returns the positions kept (None:
        the cache cannot)."""


class StoreHitLike(Protocol):
    n_tokens: int  # prompt tokens the stored entry holds


class StoreOps(Protocol):
    """The KV store tier, as the prefix cache uses it (``homepd.worker.storekv`` gives it)."""
    n_entries: int
    used_bytes: int
    capacity_bytes: int                      # 0: no store attached (saves and lookups do nothing)
    save_ms_per_token: float | None          # measured (None: nothing saved yet): a save's cost per token
    save_base_ms: float | None               # ... and its fixed part (``homepd.kv.savecost``)
    restore_ms_per_token: float | None       # measured (None: nothing restored yet)
    # ms its saves and restores have taken so far: they run between two steps, and the streams wait for them (a
    # conversation 900 cells deep took 170 ms to save without flash attention: the transposed V cache is copied by rows)
    busy_ms: float

    def save(self, seq_id: int, tokens: tuple[int, ...]) -> None:
        """``seq_id``'s KV (holding ``tokens``) is about to be dropped from the context, or its model unloaded
        (``PrefixReuse.save_all``): keep it if worth it."""

    def lookup(self, prompt_ids, mode: ReuseMode, max_tokens: int) -> StoreHitLike | None:
        """The stored entry sharing the longest prefix with ``prompt_ids`` (at most ``max_tokens`` of it)."""

    def peek(self, prompt_ids, mode: ReuseMode, max_tokens: int) -> StoreHitLike | None:
        """What ``lookup`` would find, leaving the entries' recency as it is."""

    def is_faster(self, hit, n_context_tokens: int) -> bool:
        """Whether restoring ``hit`` beats prefilling what it holds beyond the context's ``n_context_tokens``."""

    def restore(self, hit, seq_id: int) -> int | None:
        """Load ``hit`` into empty ``seq_id``, keeping its first ``hit.n_tokens`` positions; returns the
        positions held (None: it could not, ``seq_id`` may hold anything: drop it)."""


def store_is_faster(n_restore_tokens: int, n_gain_tokens: int, restore_ms_per_token: float | None,
                    estimate: StepEstimate | None) -> bool:
    """Restore ``n_restore_tokens`` from the store, or prefill the ``n_gain_tokens`` it would save?  Compares
    the measured restore cost with the worker's step-time model (the one owner of step time).  Before either
    is measured the store is tried: the first restore measures it (a restore is a memory copy, a prefill
    runs the model)."""
    if n_gain_tokens <= 0:
        return False
    if restore_ms_per_token is None or estimate is None:
        return True
    prefill_ms = estimate.predict_ms(n_gain_tokens, 0, n_gain_tokens) - estimate.base_ms
    return restore_ms_per_token * n_restore_tokens < prefill_ms


def store_fits(ms_per_token: float | None, n_tokens: int, limit_ms: float | None, base_ms: float | None = 0.0) -> bool:
    """Whether a save or restore of ``n_tokens`` at the store's measured cost takes at most ``limit_ms`` (None: no
    limit, or not measured yet)."""
    return limit_ms is None or ms_per_token is None or (base_ms or 0.0) + ms_per_token * n_tokens <= limit_ms


class PrefixReuse:
    """A worker's cached prefixes: what it keeps, who takes what, what is evicted, and its counters."""

    def __init__(self, allocator: KVAllocator, kv: KVOps, mode: ReuseMode, max_cached_cells: int,
                 store: StoreOps | None = None):
        assert mode is not ReuseMode.OFF and max_cached_cells >= 0
        self.allocator, self.kv, self.mode = allocator, kv, mode
        self.max_cached_cells = max_cached_cells
        self.store = store
        self.index = PrefixIndex()
        self.n_lookups = self.n_hits = self.n_lookup_tokens = self.n_hit_tokens = self.n_evictions = 0
        self.n_store_hits = self.n_store_hit_tokens = 0
        self.n_pauses = self.n_pause_resumed_tokens = 0  # prefills paused here; what they took back resuming
        # ids of the cached entries that are paused prefills (``pause``): they may hold the allocator's ids kept
        # for cached prefixes; a finished sequence's entry holds one of the n_seq_max running ids' places
        self._paused: set[int] = set()
        self.save_limit_ms: float | None = None  # what the streams can wait for of saves now (the scheduler's)
        self.n_unsaved = 0

    def _save(self, entry, paused: bool) -> None:
        """``entry``'s KV into the store, unless the streams cannot wait for its save (``save_limit_ms``; in the twin
        nearly every gap miss left at 0.86 req/s was one); a paused prefill's always (it would be lost work).  A save
        made takes its time out of the limit (saves between two steps add up: ``Scheduler._less_store_spent``)."""
        store = self.store
        if paused or store_fits(store.save_ms_per_token, len(entry.tokens), self.save_limit_ms, store.save_base_ms):
            before = store.busy_ms
            store.save(entry.seq_id, entry.tokens)
            if self.save_limit_ms is not None:
                self.save_limit_ms = max(0.0, self.save_limit_ms - (store.busy_ms - before))
        else:
            self.n_unsaved += 1

    def keep(self, seq: Sequence) -> bool:
        """seq (running, holding its sequence id) leaves: keep its KV as an entry.  False if nothing to keep
        (the caller frees the id and drops its KV as before)."""
        n_kv = seq.n_kv_tokens
        if n_kv <= 0 or self.max_cached_cells <= 0:
            return False
        tokens = (seq.prompt_ids + seq.output_ids)[:n_kv]
        duplicate = self.index.duplicate_of(tokens)
        if duplicate is not None:
            self.evict(duplicate, save=False)  # the new entry holds the same KV
        self.allocator.cache(seq.seq_id, n_kv)
        self.index.insert(seq.seq_id, tokens)
        while self.allocator.n_cells_cached_only > self.max_cached_cells and self.evict_lru():
            pass
        return True

    def pause(self, seq: Sequence) -> bool:
        """seq's prefill gives its sequence id to a prompt ahead: its computed KV is kept as an entry (``keep``),
        which it takes back when it resumes.  False if nothing could be kept."""
        if not self.keep(seq):
            return False
        self._paused.add(seq.seq_id)
        self.n_pauses += 1
        return True

    @property
    def n_finished_cached(self) -> int:
        """Cached entries of finished sequences (not paused prefills)."""
        return self.allocator.n_cached - len(self._paused)

    def _slot_room(self, keep=None) -> bool:
        """Evict finished entries (LRU, never ``keep``) until one more sequence may run beside the running ones
        and the finished entries: those share the running places (``n_run_limit``), as when no ids were kept for
        cached prefixes; only paused prefills hold the ids beyond them.  False if that cannot be done.
        # why: a finished request's KV costs every step (attended over) and may never be asked for again: kept under
        # the extra ids, one-shot traffic met its SLO for 12 of 24 requests at 0.5 req/s against 24 (2 threads)"""
        a = self.allocator
        while a.n_running + self.n_finished_cached >= a.n_run_limit:
            finished = [e for e in self.index.lru() if e.seq_id not in self._paused and e is not keep]
            if not finished:
                return False
            self.evict(finished[0])
        return True

    def expected_reuse(self, seq: Sequence) -> int:
        """The prompt tokens waiting seq would take from the context's cached prefixes or the store if
        admitted now (the rule of ``take``, without taking or touching anything)."""
        match = self._context_match(seq)
        n_context = 0 if match is None else match.n_tokens
        if self.store is not None:
            # why the store too: with more conversations than sequence ids, a follow-up's history is often in
            # the store only; counted as its whole prompt, the deadline order judged a 33-token turn late and
            # set it behind two documents (it waited 24 s at 1 thread, chat_bench --kind mix)
            hit = self.store.peek(seq.prompt_ids, self.mode, seq.n_prompt - 1)
            if self._store_wins(hit, n_context):
                return hit.n_tokens
        return n_context

    def _store_wins(self, hit, n_context: int, limit_ms: float | None = None) -> bool:
        """Whether the store's ``hit`` is taken over the context's match of ``n_context`` tokens: it holds more
        (and not a mere shared head), and restoring it beats prefilling what it adds (within ``limit_ms``)."""
        return hit is not None and hit.n_tokens >= max(n_context + 1, MIN_PARTIAL_MATCH_TOKENS) \
            and self.store.is_faster(hit, n_context) \
            and store_fits(self.store.restore_ms_per_token, len(hit.entry.tokens), limit_ms)

    def _context_match(self, seq: Sequence):
        """The cached entry seq's prompt would take (all but its last token at most), or None: nothing, or a
        partial match under ``MIN_PARTIAL_MATCH_TOKENS`` (a shared BOS is not a hit)."""
        match = self.index.longest_match(seq.prompt_ids, self.mode, max_tokens=seq.n_prompt - 1)
        if match is not None and match.n_tokens < min(match.entry.n_cells, MIN_PARTIAL_MATCH_TOKENS):
            return None
        return match

    def take(self, seq: Sequence, n_cells: int, restore_limit_ms: float | None = None) -> bool:
        """Give waiting seq (nothing prefilled) the cached entry matching its prompt longest, reserving
        ``n_cells`` under that entry's id, and mark the kept prefix as prefilled.  False: nothing matched
        (or the context refused the trim); seq has no id then.  ``restore_limit_ms``: the longest restore from
        the store it may make now (``StepPolicy.restore_limit_ms``; None: any that beats prefilling)."""
        assert self.allocator.can_run_more, "take() for a request that may not run yet"
        if not seq.n_pauses:  # a paused prefill resuming is not a new prompt looked up
            self.n_lookups += 1
            self.n_lookup_tokens += seq.n_prompt
        match = self._context_match(seq)
        if self.store is not None:
            hit = self.store.lookup(seq.prompt_ids, self.mode, seq.n_prompt - 1)
            n_context = match.n_tokens if match is not None else 0
            if self._store_wins(hit, n_context, restore_limit_ms) and \
                    self._restore(seq, hit, n_cells, restore_limit_ms):
                return True
            if match is not None and self.index.entry_of(match.entry.seq_id) is not match.entry:
                match = None  # evicted making room for a restore that failed
        if match is None:
            return False
        entry, n_keep = match.entry, match.n_tokens
        if n_keep < entry.n_cells and self.kv.can_share and self._copy(seq, entry, n_keep, n_cells):
            return True
        while not self.allocator.can_take(entry.seq_id, n_cells):
            others = [e for e in self.index.lru() if e is not entry]
            if not others:
                return False
            self.evict(others[0])
        if entry.seq_id in self._paused and not self._slot_room(keep=entry):
            return False
        self.index.remove(entry)
        paused = entry.seq_id in self._paused
        self._paused.discard(entry.seq_id)
        if n_keep < entry.n_cells:
            if self.store is not None:
                # why: the trim drops the entry's tail for good; a chat turn sharing only the system prompt
                # took a paused document's 400 computed tokens (and other conversations' histories) this way
                self._save(entry, paused)
            kept = self.kv.trim(entry.seq_id, n_keep)
            if kept is None:
                self.kv.drop(entry.seq_id)
                self.allocator.uncache(entry.seq_id)
                self.n_evictions += 1
                return False
            n_keep = min(kept, seq.n_prompt - 1)  # what the context says it kept (the last token is computed)
            self.allocator.trim_cached(entry.seq_id, n_keep)
        self.allocator.take(entry.seq_id, n_cells)
        self._reused(seq, entry.seq_id, n_keep)
        return True

    def _copy(self, seq: Sequence, entry, n_keep: int, n_cells: int) -> bool:
        """seq gets the entry's first ``n_keep`` cells under a new id (the entry stays cached), evicting
        other entries (LRU) as far as an id and the cells need; False if that cannot be done."""
        if not self._slot_room(keep=entry):
            return False
        while not self.allocator.can_allocate_sharing(n_cells, n_keep):
            others = [e for e in self.index.lru() if e is not entry]
            if not others:
                return False
            self.evict(others[0])
        seq_id = self.allocator.allocate_sharing(n_cells, entry.seq_id, n_keep)
        n_got = self.kv.copy(entry.seq_id, seq_id, n_keep)
        entry.last_used = self.index.touch()
        self._reused(seq, seq_id, min(n_got, seq.n_prompt - 1))
        return True

    def _restore(self, seq: Sequence, hit, n_cells: int, limit_ms: float | None = None) -> bool:
        """seq gets a new id holding the store's entry (its first ``hit.n_tokens`` positions); False if no id
        and cells can be freed for it, the saves that freed them left too little of ``limit_ms`` for it, or the
        restore failed (nothing is held then)."""
        before = self.store.busy_ms
        self.make_room(n_cells)
        if not self.allocator.can_allocate(n_cells):
            return False
        if limit_ms is not None and not store_fits(self.store.restore_ms_per_token, len(hit.entry.tokens),
                                                   limit_ms - (self.store.busy_ms - before)):
            return False
        seq_id = self.allocator.allocate(n_cells)
        n_got = self.store.restore(hit, seq_id)
        if not n_got:
            self.kv.drop(seq_id)
            self.allocator.free(seq_id)
            return False
        self._reused(seq, seq_id, min(n_got, seq.n_prompt - 1))
        seq.is_restored = True
        if not seq.n_pauses:
            self.n_store_hits += 1
            self.n_store_hit_tokens += seq.n_reused
        return True

    def _reused(self, seq: Sequence, seq_id: int, n_keep: int) -> None:
        seq.seq_id, seq.n_prefilled, seq.n_reused = seq_id, n_keep, n_keep
        if seq.n_pauses:  # it takes back what it computed itself before its pause: no cache hit
            self.n_pause_resumed_tokens += n_keep
            return
        self.n_hits += 1
        self.n_hit_tokens += n_keep

    def evict(self, entry, save: bool = True) -> None:
        """Drop ``entry`` from the context; with a store and ``save``, it is saved there first."""
        self.index.remove(entry)
        paused = entry.seq_id in self._paused
        self._paused.discard(entry.seq_id)
        self.allocator.uncache(entry.seq_id)
        if save and self.store is not None:
            self._save(entry, paused)
        self.kv.drop(entry.seq_id)
        self.n_evictions += 1

    def save_all(self) -> int:
        """Save every cached entry into the store, its KV kept in the context, the least recently used first
        (so that when the store is full the hottest prefixes are the ones it keeps); the entries offered."""
        if self.store is None:
            return 0
        entries = self.index.lru()
        for entry in entries:
            self.store.save(entry.seq_id, entry.tokens)
        return len(entries)

    def evict_lru(self) -> bool:
        """Evict the least recently used entry; False if there is none."""
        entries = self.index.lru()
        if not entries:
            return False
        self.evict(entries[0])
        return True

    def make_room(self, n_cells: int) -> None:
        """Evict (LRU) until a sequence id is free and ``n_cells`` more cells are unreserved, as far as
        cached entries allow."""
        if not self.allocator.can_run_more or not self._slot_room():
            return  # no eviction gives an id that may run
        while not self.allocator.can_allocate(n_cells) and self.evict_lru():
            pass

    def stats(self, bytes_per_cell: int = 0) -> PrefixCacheStats:
        # why: cells a cached entry shares with a running request are the request's (counted once, there)
        n_cells = self.allocator.n_cells_cached_only
        return PrefixCacheStats(
            n_lookups=self.n_lookups, n_hits=self.n_hits, n_lookup_tokens=self.n_lookup_tokens,
            n_hit_tokens=self.n_hit_tokens, n_evictions=self.n_evictions, n_cached_entries=len(self.index),
            n_cached_cells=n_cells, cached_bytes=n_cells * bytes_per_cell, mode=self.mode,
            n_store_entries=self.store.n_entries if self.store is not None else 0,
            store_bytes=self.store.used_bytes if self.store is not None else 0,
            n_store_hits=self.n_store_hits, n_store_hit_tokens=self.n_store_hit_tokens,
            n_store_no_room=self.store.n_no_room if self.store is not None else 0,
            n_pauses=self.n_pauses, n_pause_resumed_tokens=self.n_pause_resumed_tokens,
            store_capacity_bytes=self.store.capacity_bytes if self.store is not None else 0,
            store_save_ms_per_token=self.store.save_ms_per_token if self.store is not None else None,
            store_save_base_ms=self.store.save_base_ms if self.store is not None else None,
            store_restore_ms_per_token=self.store.restore_ms_per_token if self.store is not None else None)
