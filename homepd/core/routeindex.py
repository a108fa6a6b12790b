"""The controller's approximate picture of one worker's prefix cache: a radix tree over token ids.

Cache-aware routing (as SGLang's router does it) asks "how many tokens of this prompt does worker W
probably hold?" without asking the worker.  The controller inserts what it sent to W (a prompt) and what
finished there (prompt + output), and the tree answers with the longest common prefix.  It is only an
approximation: the worker evicts cached prefixes when running requests need cells, unseen by the
controller, so the tree ages its entries out by the same kind of rule:

* **budget**: the distinct tokens held never exceed ``capacity_tokens`` (the worker's KV cells,
  ``n_ctx``: a worker cannot hold more, running and cached together);
* **LRU**: over budget, the least recently used leaf goes first (a leaf is a whole cached tail; an
  inner node only goes once its children have); ``insert`` and ``touch`` refresh a path, ``match`` does not
  (routing looks at every worker but sends to one);
* **correction**: when the worker reports the real reuse of a prompt (``truncate``), what the tree held
  beyond it on that prompt's path is dropped.

Self-contained and pure (no clock: recency is an insertion counter).  The worker's own prefix index
(``homepd.core`` of the prefix-reuse work) is a separate structure; a later change may unify them.
"""
from __future__ import annotations

import heapq
from typing import Sequence


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None", last_used: int):
        self.edge = edge                      # the token ids from the parent to here
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's edge
        self.parent = parent
        self.last_used = last_used


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RouteIndex:
    """Token prefixes one worker probably holds, within ``capacity_tokens`` distinct tokens."""

    def __init__(self, capacity_tokens: int):
        assert capacity_tokens >= 0, capacity_tokens
        self.capacity_tokens = capacity_tokens
        self.root = _Node((), None, 0)
        self.n_tokens = 0      # distinct tokens held (the sum of the edges)
        self.n_evicted_tokens = 0
        self._clock = 0

    def __len__(self) -> int:
        return self.n_tokens

    # queries ----------------------------------------------------------------------------------------
    def match(self, ids: Sequence[int]) -> int:
        """The length of the longest prefix of ``ids`` held (0: none).  Does not refresh recency."""
        return self._walk(ids)[0]

    # updates ----------------------------------------------------------------------------------------
    def insert(self, ids: Sequence[int]) -> None:
        """``ids`` is held now (sent to or finished on the worker): add it, refresh its path, then evict
        least recently used leaves until the budget holds."""
        ids = tuple(ids)
        self._clock += 1
        node, depth = self.root, 0
        node.last_used = self._clock
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                new = _Node(ids[depth:], node, self._clock)
                node.children[ids[depth]] = new
                self.n_tokens += len(new.edge)
                break
            k = _common(child.edge, ids[depth:])
            if k < len(child.edge):
                child = self._split(child, k)
            child.last_used = self._clock
            node, depth = child, depth + k
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
        node, start = self.root, 0  # ``start``: the depth where ``node``'s edge begins (ids matches up to
        while True:                 # beyond n_held, so every edge on the way is ids' own)
            if start + len(node.edge) > n_held:  # ids[n_held] lies on this edge: cut there
                if n_held > start:
                    self._split(node, n_held - start)  # ``node`` keeps the part from ids[n_held] on
                self._remove(node)
                return
            start += len(node.edge)
            node = node.children[ids[start]]

    def evict_tokens(self, n_tokens: int, keep: Sequence[int] = ()) -> None:
        """Drop about ``n_tokens`` of the least recently used tokens (whole leaves), sparing the held
        prefix of ``keep`` (the worker reused less than the tree said: it had aged more out)."""
        self._evict_to(max(0, self.n_tokens - n_tokens), keep)

    def resize(self, capacity_tokens: int) -> None:
        """A new budget (the worker's cells changed, or it restarted with another context)."""
        self.capacity_tokens = max(0, capacity_tokens)
        self._evict_to(self.capacity_tokens)

    def clear(self) -> None:
        """Forget everything (the worker restarted: its context is empty)."""
        self.root = _Node((), None, 0)
        self.n_tokens = 0

    # internals ----------------------------------------------------------------------------------------
    def _walk(self, ids: Sequence[int]) -> tuple[int, _Node]:
        """(tokens of ``ids`` held, the deepest node its held prefix reaches)."""
        node, depth = self.root, 0
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                break
            k = _common(child.edge, ids[depth:])
            node, depth = child, depth + k
            if k < len(child.edge):
                break
        return depth, node

    def _path(self, ids: Sequence[int]) -> list[_Node]:
        _, node = self._walk(ids)
        path = []
        while node is not None:
            path.append(node)
            node = node.parent
        return path

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node``'s edge after ``k`` tokens; returns the new upper node (``node`` goes below it)."""
        assert 0 < k < len(node.edge), (k, len(node.edge))
        parent = node.parent
        upper = _Node(node.edge[:k], parent, node.last_used)
        parent.children[node.edge[0]] = upper
        node.edge = node.edge[k:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _remove(self, node: _Node) -> None:
        """Drop ``node`` and everything below it."""
        assert node is not self.root
        stack, n = [node], 0
        while stack:
            cur = stack.pop()
            n += len(cur.edge)
            stack.extend(cur.children.values())
        del node.parent.children[node.edge[0]]
        self.n_tokens -= n
        self.n_evicted_tokens += n

    def _evict_to(self, capacity_tokens: int, keep: Sequence[int] = ()) -> None:
        if self.n_tokens <= capacity_tokens:
            return
        spared = {id(node) for node in self._path(keep)} if keep else set()
        # why a heap with parents pushed as they become leaves: a parent is never older than its children,
        # but once they are gone it may be older than other leaves, and LRU takes it first then
        heap, stack = [], [self.root]
        while stack:
            cur = stack.pop()
            if cur.children:
                stack.extend(cur.children.values())
            elif cur is not self.root and id(cur) not in spared:
                heap.append((cur.last_used, id(cur), cur))
        heapq.heapify(heap)
        while self.n_tokens > capacity_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._remove(leaf)
            if parent is not self.root and not parent.children and id(parent) not in spared:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
