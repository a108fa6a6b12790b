"""The controller's approximate picture of one worker's prefix cache: a radix tree over token ids.

Cache-aware routing (as SGLang's router does it) asks "how many tokens of this prompt does worker W probably hold?"
without asking the worker.  The controller inserts what it sent to W (a prompt) and what finished there (prompt +
output), and the tree answers with the longest common prefix.  It is only an approximation: the worker evicts
cached prefixes when running requests need cells, unseen by the controller, so the tree ages its entries out by the
same kind of rule:

* **budget**: the distinct tokens held never exceed ``capacity_tokens`` (the worker's KV cells,
  ``n_ctx``: a worker cannot hold more, running and cached together);
* **LRU**: over budget, the least recently used leaf goes first (a leaf is a whole cached tail; an
  inner node only goes once its children have); ``insert`` and ``touch`` refresh a path, ``match`` does not
  (routing looks at every worker but sends to one);
* **correction**: when the worker reports the real reuse of a prompt (``truncate``), what the tree held
  beyond it on that prompt's path is dropped.

Pure (no clock: recency is an insertion counter).  The tree is ``homepd.core.radix.TokenTrie``, the one the
worker's prefix cache and the KV store index by too.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from homepd.core.radix import TokenTrie, TrieNode


class RouteIndex:
    """Token prefixes one worker probably holds, within ``capacity_tokens`` distinct tokens."""

    def __init__(self, capacity_tokens: int):
        assert capacity_tokens >= 0, capacity_tokens
        self.capacity_tokens = capacity_tokens
        self.trie = TokenTrie()
        self.n_evicted_tokens = 0
        self._clock = 0

    def __len__(self) -> int:
        return self.n_tokens

    @property
    def n_tokens(self) -> int:
        """Distinct tokens held (the sum of the edges)."""
        return self.trie.n_tokens

    # queries ----------------------------------------------------------------------------------------
    def match(self, ids: Sequence[int]) -> int:
        """The length of the longest prefix of ``ids`` held (0: none).  Does not refresh recency."""
        return self.trie.walk(ids)[0]

    # updates ----------------------------------------------------------------------------------------
    def insert(self, ids: Sequence[int]) -> None:
        """``ids`` is held now (sent to or finished on the worker): add it, refresh its path, then evict
        least recently used leaves until the budget holds."""
        self._clock += 1
        self.trie.insert(ids, self._clock)
        self._evict_to(self.capacity_tokens)

    def touch(self, ids: Sequence[int]) -> None:
        """Refresh the recency of the held prefix of ``ids`` (a request reused it)."""
        self._clock += 1
        for node in self._path(ids):
            node.last_used = self._clock

    def truncate(self, ids: Sequence[int], n_held: int) -> None:
        """The worker holds only ``n_held`` tokens of ``ids``: forget what the tree held beyond that on
        this path (other branches are left alone: the worker's longest match says nothing of them)."""
        if self.match(ids) <= n_held:
            return
        node, start = self.trie.root, 0  # ``start``: the depth where ``node``'s edge begins (ids matches up
        while True:                      # to beyond n_held, so every edge on the way is ids' own)
            if start + len(node.edge) > n_held:  # ids[n_held] lies on this edge: cut there
                if n_held > start:
                    self.trie.split(node, n_held - start)  # ``node`` keeps the part from ids[n_held] on
                self._remove(node)
                return
            start += len(node.edge)
            node = node.children[ids[start]]

    def evict_tokens(self, n_tokens: int, keep: Sequence[int] = ()) -> None:
        """Drop about ``n_tokens`` of the least recently used tokens (whole leaves), sparing the held
        prefix of ``keep`` (the worker reused less than the tree said: it had aged more out)."""
        self._evict_to(max(0, self.n_tokens - n_tokens), keep)

    def clear(self) -> None:
        """Forget everything (the worker restarted: its context is empty)."""
        self.trie.clear()

    # internals ----------------------------------------------------------------------------------------
    def _path(self, ids: Sequence[int]) -> list[TrieNode]:
        """The nodes from the deepest one ``ids`` reaches up to the root."""
        node, path = self.trie.walk(ids)[1], []
        while node is not None:
            path.append(node)
            node = node.parent
        return path

    def _remove(self, node: TrieNode) -> None:
        """Drop ``node`` and everything below it."""
        self.n_evicted_tokens += self.trie.remove(node)

    def _evict_to(self, capacity_tokens: int, keep: Sequence[int] = ()) -> None:
        if self.n_tokens <= capacity_tokens:
            return
        spared = {id(node) for node in self._path(keep)} if keep else set()
        # why a heap with parents pushed as they become leaves: a parent is never older than its children,
        # but once they are gone it may be older than other leaves, and LRU takes it first then
        heap, stack = [], [self.trie.root]
        while stack:
            cur = stack.pop()
            if cur.children:
                stack.extend(cur.children.values())
            elif cur is not self.trie.root and id(cur) not in spared:
                heap.append((cur.last_used, id(cur), cur))
        heapq.heapify(heap)
        while self.n_tokens > capacity_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._remove(leaf)
            if parent is not self.trie.root and not parent.children and id(parent) not in spared:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
