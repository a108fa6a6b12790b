"""The KV store tier's hands in a worker (``homepd.core.prefixreuse.StoreOps``): save an evicted prefix
into the worker's store segment, find and restore one, and time both.

Saves run inside the step loop, at the eviction that needs the cells (the cells must be free before the
next step), so a save is a plain ``llama_state_seq_get_data`` into the shared mapping and nothing more;
prefixes shorter than ``MIN_STORE_TOKENS`` are not saved (recomputing them costs little).  Its cost per
token is measured here and shown by ``benchmarks/kv_store.py``.
"""
from __future__ import annotations

import time
from typing import Callable

from homepd.core.terms import ReuseMode, StepEstimate
from homepd.core.prefixreuse import store_is_faster
from homepd.core.protocol import AttachStore, StoreDropped
from homepd.errors import ExtentError, HomepdError
from homepd.kv.savecost import SaveCost
from homepd.kv.store import StoreSegment, saved_message
from homepd.kv.storeindex import StoreHit
from homepd.kv.segment import unlink_pool_of

# why 64: below it a prefill of the prefix is a few ms on a CPU; the save would cost about as much as it saves
MIN_STORE_TOKENS = 64
_EMA = 0.3  # weight of the newest restore in the measured cost per token


class ContextStore:
    """One worker's store segment, attached when the controller sends ``AttachStore``.

    ``fault="store_off_by_one"`` (test-only) keeps one cell past the matched prefix of a restored entry: the
    request then holds, where its prompt parts from the saved sequence, that sequence's token instead of its
    own (tests/integration/test_kv_store.py shows the teacher-forced check failing on it)."""

    def __init__(self, ctx, send: Callable[[object], None], model_fingerprint: str,
                 estimate: Callable[[], StepEstimate | None], fault: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ctx, self.send, self.model_fingerprint, self.estimate = ctx, send, model_fingerprint, estimate
        self.fault, self.clock = fault, clock
        self.busy_ms = 0.0  # saves and restores so far (StoreOps.busy_ms)
        self.segment: StoreSegment | None = None
        self.restore_ms_per_token: float | None = None  # measured (EMA); None until the first restore
        # a save's fixed part and its cost per token, fitted over every save so far (``SaveCost``)
        self.save_base_ms: float | None = None
        self.save_ms_per_token: float | None = None
        self._save_cost = SaveCost()

    def attach(self, msg: AttachStore) -> None:
        if self.segment is not None:
            self.segment.close()
        self.segment = StoreSegment(msg, self.model_fingerprint, self.ctx.n_ctx)

    @property
    def n_entries(self) -> int:
        return len(self.segment.index) if self.segment is not None else 0

    @property
    def used_bytes(self) -> int:
        return self.segment.index.used_bytes if self.segment is not None else 0

    @property
    def capacity_bytes(self) -> int:
        return self.segment.index.capacity_bytes if self.segment is not None else 0

    @property
    def n_no_room(self) -> int:
        return self.segment.n_no_room if self.segment is not None else 0

    def save(self, seq_id: int, tokens: tuple[int, ...]) -> None:
        store = self.segment
        if store is None or len(tokens) < MIN_STORE_TOKENS or store.index.covers(tokens):
            return
        dropped = store.index.superseded_by(tokens)
        for old in dropped:
            store.drop(old)
        t0 = self.clock()
        try:
            entry, evicted = store.save(tokens, self.ctx.state_size(seq_id),
                                        lambda view: self.ctx.state_get(seq_id, view))
        except HomepdError:
            entry, evicted = None, []  # not saved: the prefix is recomputed when it comes back
        took_ms = (self.clock() - t0) * 1e3
        self.busy_ms += took_ms
        if entry is not None:
            # why every save, not the latest: one save's time swings x2 (a page first touched, the other worker's
            # step beside it), and the twin's calibration read the latest (homepd.twin.calibration)
            self._save_cost.add(len(tokens), took_ms)
            self.save_base_ms, self.save_ms_per_token = self._save_cost.fit()
        gone = tuple(e.offset for e in (*dropped, *evicted))
        if gone:
            self.send(StoreDropped(gone))
        if entry is not None:
            self.send(saved_message(entry))

    def lookup(self, prompt_ids, mode: ReuseMode, max_tokens: int) -> StoreHit | None:
        """The longest match, made the most recently used entry: # why: making room in the context for its
        restore saves other prefixes into the store, which must not evict this one first."""
        hit = self.peek(prompt_ids, mode, max_tokens)
        if hit is not None:
            self.segment.index.touch(hit.entry)
        return hit

    def peek(self, prompt_ids, mode: ReuseMode, max_tokens: int) -> StoreHit | None:
        """The longest match, the entries' recency left as it is."""
        return self.segment.index.longest_match(prompt_ids, mode, max_tokens) if self.segment is not None else None

    def is_faster(self, hit: StoreHit, n_context_tokens: int) -> bool:
        return store_is_faster(len(hit.entry.tokens), hit.n_tokens - n_context_tokens, self.restore_ms_per_token,
                               self.estimate())

    def restore(self, hit: StoreHit, seq_id: int) -> int | None:
        store = self.segment
        if store.index.entry_at(hit.entry.offset) != hit.entry:
            return None  # evicted since the lookup (the store filled while room was made for it)
        t0 = self.clock()
        try:
            store.read(hit.entry, lambda view, n_bytes: self.ctx.state_set(seq_id, view, n_bytes))
        except ExtentError:
            store.drop(hit.entry)  # unreadable (overwritten, or another model's): never tried again
            self.send(StoreDropped((hit.entry.offset,)))
            return None
        except HomepdError:
            return None  # the context refused it (no room for its cells now): the entry stays for later
        finally:
            took_ms = (self.clock() - t0) * 1e3
            self.busy_ms += took_ms
        n_pos = self.ctx.seq_n_pos(seq_id)
        ms = took_ms / max(1, n_pos)
        self.restore_ms_per_token = ms if self.restore_ms_per_token is None else \
            (1 - _EMA) * self.restore_ms_per_token + _EMA * ms
        n_keep = hit.n_tokens + 1 if self.fault == "store_off_by_one" else hit.n_tokens
        if n_keep < n_pos and self.ctx.seq_trim(seq_id, n_keep) is None:
            return None
        store.index.touch(hit.entry)
        return min(n_pos, n_keep)

    def abandon(self) -> None:
        """The controller is gone: unlink its store segment (it cannot any more)."""
        if self.segment is not None:
            unlink_pool_of(self.segment.arena.owner_pid, self.segment.arena.token)
            self.segment.close()
            self.segment = None
