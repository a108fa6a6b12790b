"""A radix tree over token ids: the one prefix trie of homepd.

Two indexes stand on it: the worker's own prefix cache and the KV store's (``homepd.core.prefixcache.
PrefixIndex``: entries, each a sequence's tokens, ending at nodes), and the controller's picture of what each
worker holds, for routing (``homepd.core.routeindex.RouteIndex``: a token budget, aged out least recently used
first).  Edges are runs of tokens, so a prompt of thousands of tokens is one node until another prompt parts from
it, and every path from the root spells a prefix once however many entries share it.

Pure (no clock: ``last_used`` is the caller's counter).
"""
from __future__ import annotations

from typing import Sequence


class TrieNode:
    """The tokens ``edge`` below ``parent``; ``children`` keyed by the first token of their edge."""
    __slots__ = ("edge", "children", "parent", "last_used", "ends", "n_below")

    def __init__(self, edge: tuple[int, ...], parent: "TrieNode | None", last_used: int = 0):
        self.edge = edge
        self.children: dict[int, TrieNode] = {}
        self.parent = parent
        self.last_used = last_used   # the caller's recency counter (routing's LRU)
        self.ends: list = []         # the entries whose tokens end where this edge ends (the prefix cache's)
        self.n_below = 0             # entries whose tokens pass through or end on this node (the prefix cache's)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TokenTrie:
    """The tree, and the distinct tokens it holds (``n_tokens``, the sum of the edges)."""

    def __init__(self) -> None:
        self.root = TrieNode((), None)
        self.n_tokens = 0

    def walk(self, ids: Sequence[int], limit: int | None = None) -> tuple[int, TrieNode, list[tuple[int, TrieNode]]]:
        """How far ``ids`` (at most ``limit`` of it) follows the tree: (tokens matched, the deepest node
        reached, whose edge may be matched only in part, and (depth, node) for each node on the way whose
        whole edge was matched, root first, root excluded)."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        node, depth, whole = self.root, 0, []
        while depth < limit:
            child = node.children.get(ids[depth])
            if child is None:
                break
            k = common_length(child.edge, ids[depth:limit])
            node, depth = child, depth + k
            if k < len(child.edge):
                break
            whole.append((depth, child))
        return depth, node, whole

    def insert(self, ids: Sequence[int], last_used: int = 0) -> list[TrieNode]:
        """Make ``ids`` a path that ends where a node's edge ends (splitting an edge where it parts, adding
        a leaf for the rest); returns the path's nodes, root first, each given ``last_used``."""
        ids = tuple(ids)
        node, depth = self.root, 0
        node.last_used = last_used
        path = [node]
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                child = TrieNode(ids[depth:], node, last_used)
                node.children[ids[depth]] = child
                self.n_tokens += len(child.edge)
                path.append(child)
                break
            k = common_length(child.edge, ids[depth:])
            if k < len(child.edge):
                child = self.split(child, k)
            child.last_used = last_used
            path.append(child)
            node, depth = child, depth + k
        return path

    def split(self, node: TrieNode, k: int) -> TrieNode:
        """Split ``node``'s edge after ``k`` tokens; returns the new upper node (``node`` goes below it,
        keeping its ends).  The entries through ``node`` pass through the upper node too."""
        assert 0 < k < len(node.edge), (k, len(node.edge))
        parent = node.parent
        upper = TrieNode(node.edge[:k], parent, node.last_used)
        upper.n_below = node.n_below
        parent.children[node.edge[0]] = upper
        node.edge = node.edge[k:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def remove(self, node: TrieNode) -> int:
        """Drop ``node`` and everything below it; returns the tokens dropped."""
        assert node is not self.root
        stack, n = [node], 0
        while stack:
            cur = stack.pop()
            n += len(cur.edge)
            stack.extend(cur.children.values())
        del node.parent.children[node.edge[0]]
        self.n_tokens -= n
        return n

    def clear(self) -> None:
        self.root = TrieNode((), None)
        self.n_tokens = 0
