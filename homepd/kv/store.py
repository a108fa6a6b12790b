"""The KV store tier's shared memory: one segment per worker, owned by the controller.

Prefixes a worker evicts from its context are saved here (``llama_state_seq_get_data`` straight into the
mapping) and restored on a later hit (``llama_state_seq_set_data`` straight from it).  The controller
creates each worker's segment (``StoreSegments.create``: a ``KVArena`` named ``homepd-kvstore-<pid>-…``, so
the memory breakdown shows it as its own row) and unlinks it at stop, so a worker that dies leaves its
saved conversations behind for the worker that replaces it.

The worker is the segment's only writer: it allocates its extents and evicts (``homepd.kv.storeindex``)
without asking anyone, so a save never waits for the controller.  It tells the controller what it saved
and dropped (``StoreSaved``, ``StoreDropped``); the controller keeps that list (``StoreBook``) and hands it
to a restarted worker (``AttachStore``), which rebuilds its index from it.  An extent being written when
the worker died is not in the list: its bytes are simply free again.

# why one segment per worker, not one shared: one writer per segment needs no lock across processes, and a
# worker's next turn is routed to the worker that held the conversation (cache-aware routing) anyway.
"""
from __future__ import annotations

import hashlib

from homepd.core.protocol import AttachStore, StoreDropped, StoreSaved
from homepd.kv.header import ExtentExpectation, ExtentHeader, ExtentState
from homepd.kv.pool import KVArena
from homepd.kv.ring import PAGE_BYTES
from homepd.errors import ExtentError
from homepd.kv.segment import STORE_PREFIX
from homepd.kv.storeindex import StoreEntry, StoreIndex

MIN_SEGMENT_BYTES = 1 << 20  # a worker's part smaller than this holds no useful prefix: no store


def entry_tag(tokens) -> str:
    """The name an entry's extent header carries: a digest of its tokens (checked on every restore)."""
    digest = hashlib.blake2b(memoryview(bytes(_token_bytes(tokens))), digest_size=12).hexdigest()
    return f"store-{digest}"


def _token_bytes(tokens) -> bytearray:
    out = bytearray()
    for t in tokens:
        out += int(t).to_bytes(4, "little", signed=True)
    return out


class StoreBook:
    """The controller's side: each worker's segment and the entries it holds (as the worker reported)."""

    def __init__(self, capacity_bytes_by_worker: dict[str, int]):
        self.segments: dict[str, KVArena] = {}
        self.entries: dict[str, dict[int, StoreEntry]] = {}
        try:
            for name, n_bytes in capacity_bytes_by_worker.items():
                n_bytes = n_bytes // PAGE_BYTES * PAGE_BYTES
                if n_bytes >= MIN_SEGMENT_BYTES:
                    # why not pre-faulted: the store fills over hours; pages are taken as saves write them
                    self.segments[name] = KVArena.create(n_bytes, prefix=STORE_PREFIX, prefault=False)
                    self.entries[name] = {}
        except BaseException:
            self.close()
            raise

    def attach_message(self, worker: str) -> AttachStore | None:
        arena = self.segments.get(worker)
        if arena is None:
            return None
        return AttachStore(arena.names, tuple((e.offset, e.extent_bytes, e.payload_bytes, e.tokens)
                                              for e in self.entries[worker].values()))

    def saved(self, worker: str, msg: StoreSaved) -> None:
        book = self.entries.get(worker)
        if book is not None:
            book[msg.offset] = StoreEntry(msg.offset, msg.extent_bytes, msg.payload_bytes, tuple(msg.tokens))

    def dropped(self, worker: str, msg: StoreDropped) -> None:
        book = self.entries.get(worker)
        if book is not None:
            for offset in msg.offsets:
                book.pop(offset, None)

    def capacity_bytes(self) -> int:
        return sum(a.capacity_bytes for a in self.segments.values())

    def close(self) -> None:
        for arena in self.segments.values():
            arena.close()
        self.segments = {}


class StoreSegment:
    """A worker's side: its attached segment and its index; saves and restores through caller-given calls
    (the context's ``state_get``/``state_set``), so no llama.cpp here."""

    def __init__(self, msg: AttachStore, model_fingerprint: str, n_ctx: int):
        self.arena = KVArena.attach(msg.names, populate=False)
        self.model_fingerprint, self.n_ctx = model_fingerprint, n_ctx
        self.index = StoreIndex(self.arena.capacity_bytes)
        self.n_no_room = 0  # saves refused: /dev/shm had no room for their pages
        for offset, extent, payload, tokens in msg.entries:
            entry = StoreEntry(offset, extent, payload, tuple(tokens))
            if self.arena.state(offset) is ExtentState.READY:
                self.index.restore_entry(entry)

    def save(self, tokens, payload_bytes: int, write) -> tuple[StoreEntry | None, list[StoreEntry]]:
        """Save an entry of ``payload_bytes`` for ``tokens``: ``write(view)`` fills the payload and returns
        the bytes written.  Returns (the entry, or None if it cannot fit or /dev/shm has no room for its
        pages; the entries evicted for it, gone either way)."""
        placed = self.index.place(payload_bytes)
        if placed is None:
            return None, []
        offset, extent, evicted = placed
        for old in evicted:
            self.arena.reset_stale(old.offset)  # FREE: a stale header is never read as an entry again
        try:
            self.arena.allocate(offset, extent)  # the segment is not pre-faulted: pages are taken here
        except ExtentError:
            self.index.abandon(offset)
            self.n_no_room += 1
            return None, evicted
        self.arena.begin(offset, extent)
        try:
            written = write(self.arena.payload(offset, payload_bytes, entry_tag(tokens)))
            self.arena.publish(offset, ExtentHeader(request_id=entry_tag(tokens),
                                                    model_fingerprint=self.model_fingerprint, n_ctx=self.n_ctx,
                                                    n_tokens=len(tokens), payload_bytes=written))
        except BaseException:
            self.arena.release(offset)
            self.index.abandon(offset)
            raise
        return self.index.insert(offset, extent, written, tokens), evicted

    def drop(self, entry: StoreEntry) -> None:
        self.index.remove(entry)
        self.arena.reset_stale(entry.offset)

    def read(self, entry: StoreEntry, read) -> int:
        """``read(view, n_bytes)`` loads the entry's payload (checked against its tokens and checksum)."""
        header, view = self.arena.peek_ready(entry.offset, ExtentExpectation(
            entry_tag(entry.tokens), self.model_fingerprint, self.n_ctx), entry.extent_bytes)
        try:
            return read(view, header.payload_bytes)
        finally:
            self.arena.release_views(entry.offset)

    def close(self) -> None:
        self.arena.close()


def saved_message(entry: StoreEntry) -> StoreSaved:
    return StoreSaved(entry.offset, entry.extent_bytes, entry.payload_bytes, entry.tokens)
