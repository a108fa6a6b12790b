"""Which token prefixes a worker's context still holds: a radix tree over token ids of finished sequences
(``homepd.core.radix.TokenTrie``, the one routing's ``RouteIndex`` stands on too).

Pure bookkeeping (no llama_cpp, no clock).  When a sequence finishes, its KV stays in the context under its own
llama.cpp sequence id, and its tokens (prompt + outputs that entered the KV) become an *entry* here.  A new prompt
asks for the entry sharing its longest prefix (``longest_match``); the scheduler then hands that entry's sequence
id to the request, which keeps the matched cells, drops the rest (``llama_memory_seq_rm(seq, n, -1)``) and prefills
only the remainder.  The chat template's fixed head (a system prompt) is a prefix like any other: it matches the
head of any conversation that had it.

Entries are evicted least recently used first (``lru``): the scheduler drops them whenever a running or newly
admitted request needs their cells or their sequence id, so a cached prefix never makes a running request wait.

A ``ReuseMode`` says what the context's cache type allows (``homepd.llm``): ``PREFIX``, any prefix of an entry (the
entry is trimmed to it); ``EXACT``, only an entry wholly contained in the prompt (a sliding-window or recurrent
cache cannot drop its tail: the cells before the window are gone); ``OFF``, nothing.

# why take the entry's own sequence id instead of copying its cells (``llama_memory_seq_cp``): no cell is ever
# shared by two sequences, so the allocator's counts stay physical, and it works on every KV layout (per-sequence
# streams copy whole streams) and on sliding-window caches.

The KV store indexes its saved prefixes with a ``PrefixIndex`` too (``homepd.kv.storeindex``).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from homepd.core.radix import TokenTrie, TrieNode
from homepd.core.terms import ReuseMode


@dataclass(eq=False)
class PrefixEntry:
    """A finished sequence's KV kept in the context: ``tokens`` at positions 0.. under ``seq_id``."""
    seq_id: int
    tokens: tuple[int, ...]
    last_used: int = 0  # the index's clock when cached: lower = evicted sooner

    @property
    def n_cells(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PrefixMatch:
    entry: PrefixEntry
    n_tokens: int  # prompt tokens the entry holds (positions 0..n_tokens-1), at least 1


class PrefixIndex:
    """Cached entries by token ids; each sequence id is at most one entry."""

    def __init__(self) -> None:
        self._trie = TokenTrie()
        self._by_seq_id: dict[int, PrefixEntry] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_seq_id)

    @property
    def n_cells(self) -> int:
        """Cells held by every entry (no cell is shared: each entry has its own sequence id)."""
        return sum(e.n_cells for e in self._by_seq_id.values())

    @property
    def n_tokens(self) -> int:
        """Distinct tokens the tree holds (a prefix shared by entries counts once)."""
        return self._trie.n_tokens

    def entry_of(self, seq_id: int) -> PrefixEntry | None:
        return self._by_seq_id.get(seq_id)

    def insert(self, seq_id: int, tokens: list[int] | tuple[int, ...]) -> PrefixEntry:
        """Index ``tokens`` held under ``seq_id`` (not already an entry), most recently used."""
        assert seq_id not in self._by_seq_id and tokens, (seq_id, len(tokens))
        entry = PrefixEntry(seq_id, tuple(tokens), next(self._clock))
        path = self._trie.insert(entry.tokens)
        for node in path:
            node.n_below += 1
        path[-1].ends.append(entry)
        self._by_seq_id[seq_id] = entry
        return entry

    def remove(self, entry: PrefixEntry) -> None:
        """Forget ``entry`` (taken by a request or evicted); prunes the nodes only it used."""
        assert self._by_seq_id.get(entry.seq_id) is entry
        del self._by_seq_id[entry.seq_id]
        depth, last, whole = self._trie.walk(entry.tokens)
        assert depth == len(entry.tokens) and whole and whole[-1][1] is last, "an entry's path ends at a node"
        self._trie.root.n_below -= 1
        for _, node in whole:
            node.n_below -= 1
            if node.n_below == 0:
                self._trie.remove(node)  # the rest of the path was only this entry's
                return
        last.ends.remove(entry)

    def duplicate_of(self, tokens: list[int] | tuple[int, ...]) -> PrefixEntry | None:
        """An entry holding exactly ``tokens``, if any (a second copy would only waste cells)."""
        depth, _, whole = self._trie.walk(tokens)
        if depth != len(tokens) or not whole or whole[-1][0] != depth:
            return None
        ends = whole[-1][1].ends
        return ends[0] if ends else None

    def longest_match(self, prompt_ids: list[int] | tuple[int, ...], mode: ReuseMode = ReuseMode.PREFIX,
                      max_tokens: int | None = None) -> PrefixMatch | None:
        """The entry sharing the longest prefix with ``prompt_ids``, at most ``max_tokens`` of it (None: no
        bound); among equals the one with the fewest cells beyond the match (least dropped), then the most
        recently used.  ``EXACT``: only entries wholly within that bound.  None when nothing matches."""
        if mode is ReuseMode.OFF:
            return None
        depth, node, whole = self._trie.walk(prompt_ids, max_tokens)
        # an entry wholly inside the prompt ends at a node passed whole: the deepest one is the best exact match
        best_exact = next((PrefixMatch(max(n.ends, key=lambda e: e.last_used), d)
                           for d, n in reversed(whole) if n.ends), None)
        if mode is ReuseMode.EXACT or depth == 0:
            return best_exact
        if best_exact is not None and best_exact.n_tokens == depth:
            return best_exact
        # ``node``'s edge may be matched only in part: the entries at or below it hold the match and more
        edge_start = whole[-1][0] - (len(node.edge) if whole[-1][1] is node else 0) if whole else 0
        return PrefixMatch(_least_beyond(node, edge_start + len(node.edge) - depth), depth)

    def match_length(self, prompt_ids: list[int] | tuple[int, ...], mode: ReuseMode = ReuseMode.PREFIX) -> int:
        """How many leading tokens of ``prompt_ids`` some entry holds (0: none)."""
        match = self.longest_match(prompt_ids, mode)
        return 0 if match is None else match.n_tokens

    def touch(self) -> int:
        """The clock's next tick: an entry given it is the most recently used."""
        return next(self._clock)

    def lru(self) -> list[PrefixEntry]:
        """Every entry, least recently used first: the eviction order."""
        return sorted(self._by_seq_id.values(), key=lambda e: e.last_used)


def _least_beyond(node: TrieNode, beyond: int) -> PrefixEntry:
    """The entry at or below ``node`` that ends fewest tokens past the match (``beyond``: how far past it
    ``node``'s own edge ends), the most recently used among those."""
    heap, tie = [(beyond, 0, node)], itertools.count(1)
    best: list[PrefixEntry] = []
    best_at = None
    while heap:
        at, _, cur = heapq.heappop(heap)
        if best_at is not None and at > best_at:
            break
        if cur.ends:
            best.extend(cur.ends)
            best_at = at
        for child in cur.children.values():
            heapq.heappush(heap, (at + len(child.edge), next(tie), child))
    if not best:
        raise AssertionError("a trie node with no entry below it")
    return max(best, key=lambda e: e.last_used)
