"""What a worker's part of the KV store holds: entries by token ids, their bytes, LRU eviction.

Pure bookkeeping (no shared memory, no clock): the store's bytes live in a segment owned by the controller
(``homepd.kv.store``); this says which extents of it hold which token prefixes.  An *entry* is one saved
sequence: its tokens (positions 0..n-1) and its extent (``llama_state_seq_get_data`` bytes behind a header
page, ``homepd.kv.pool``).  Extents come from a ``RingAllocator`` over the segment; when a new entry does
not fit, the least recently used entries are evicted until it does (the segment's size is the byte budget).

The token trie is ``homepd.core.prefixcache.PrefixIndex`` (the one the context's cache uses), keyed by the
extent's offset instead of a sequence id: an offset is unique among live extents.
"""
from __future__ import annotations

from dataclasses import dataclass

from homepd.core.prefixcache import PrefixIndex, PrefixMatch
from homepd.core.terms import ReuseMode
from homepd.kv.pool import extent_bytes_for
from homepd.kv.ring import RingAllocator


@dataclass(frozen=True)
class StoreEntry:
    """One saved sequence: its extent in the segment and what it holds."""
    offset: int
    extent_bytes: int
    payload_bytes: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class StoreHit:
    """The entry sharing the longest prefix with a prompt: ``n_tokens`` of its tokens are the prompt's."""
    entry: StoreEntry
    n_tokens: int


class StoreIndex:
    """Entries of one worker's store segment of ``capacity_bytes`` (data bytes, whole pages)."""

    def __init__(self, capacity_bytes: int):
        self.allocator = RingAllocator(capacity_bytes)
        self._trie = PrefixIndex()
        self._entries: dict[int, StoreEntry] = {}
        self.n_saved = self.n_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes the live extents take (headers and page rounding included): what the budget counts."""
        return self.allocator.used_bytes

    @property
    def payload_bytes(self) -> int:
        """KV state bytes held (without the extent headers)."""
        return sum(e.payload_bytes for e in self._entries.values())

    def entries(self) -> list[StoreEntry]:
        """Every entry, least recently used first."""
        return [self._entries[p.seq_id] for p in self._trie.lru()]

    def entry_at(self, offset: int) -> StoreEntry | None:
        return self._entries.get(offset)

    def covers(self, tokens) -> bool:
        """Whether an entry already holds ``tokens`` (it, or a longer sequence starting with it)."""
        return self._trie.match_length(tokens, ReuseMode.PREFIX) >= len(tokens)

    def superseded_by(self, tokens) -> list[StoreEntry]:
        """Entries whose tokens are a prefix of ``tokens``: a saved ``tokens`` holds all they hold."""
        out, rest = [], list(tokens)
        while rest:
            match = self._trie.longest_match(rest, ReuseMode.EXACT)
            if match is None:
                break
            out.append(self._entries[match.entry.seq_id])
            rest = rest[:match.n_tokens - 1]
        return out

    def can_ever_fit(self, payload_bytes: int) -> bool:
        return self.allocator.can_ever_fit(extent_bytes_for(payload_bytes))

    def place(self, payload_bytes: int) -> tuple[int, int, list[StoreEntry]] | None:
        """Room for a new entry of ``payload_bytes``: ``(offset, extent_bytes, evicted)`` — the extent taken,
        and the entries evicted (least recently used first) to make it; None if it can never fit.  The caller
        fills the extent, then ``insert``s (or ``abandon``s) it."""
        extent = extent_bytes_for(payload_bytes)
        if not self.allocator.can_ever_fit(extent):
            return None
        evicted = []
        while (offset := self.allocator.alloc(extent)) is None:
            victim = self.entries()[0]  # non-empty: an empty allocator fits anything that can ever fit
            self.remove(victim)
            self.n_evicted += 1
            evicted.append(victim)
        return offset, extent, evicted

    def abandon(self, offset: int) -> None:
        """Give back an extent ``place`` gave that was not filled."""
        self.allocator.free(offset)

    def insert(self, offset: int, extent_bytes: int, payload_bytes: int, tokens) -> StoreEntry:
        """Index a filled extent (from ``place``) as the most recently used entry."""
        entry = StoreEntry(offset, extent_bytes, payload_bytes, tuple(tokens))
        self._trie.insert(offset, entry.tokens)
        self._entries[offset] = entry
        self.n_saved += 1
        return entry

    def restore_entry(self, entry: StoreEntry) -> None:
        """Rebuild after a restart: take ``entry``'s extent (it must be free) and index it."""
        self.allocator.reserve(entry.offset, entry.extent_bytes)
        self._trie.insert(entry.offset, entry.tokens)
        self._entries[entry.offset] = entry

    def remove(self, entry: StoreEntry) -> None:
        """Forget ``entry`` and free its extent."""
        self._trie.remove(self._trie.entry_of(entry.offset))
        del self._entries[entry.offset]
        self.allocator.free(entry.offset)

    def longest_match(self, prompt_ids, mode: ReuseMode, max_tokens: int | None = None) -> StoreHit | None:
        """The entry sharing the longest prefix with ``prompt_ids`` (``PrefixIndex.longest_match``'s rules)."""
        match: PrefixMatch | None = self._trie.longest_match(prompt_ids, mode, max_tokens)
        return None if match is None else StoreHit(self._entries[match.entry.seq_id], match.n_tokens)

    def touch(self, entry: StoreEntry) -> None:
        """``entry`` was used: it is the most recently used now."""
        self._trie.entry_of(entry.offset).last_used = self._trie.touch()
