"""Which worker probably holds which prompt prefixes: one ``RouteIndex`` per worker, fed by the controller.

What goes in (SGLang's router keeps its approximate tree the same way):
* a prompt when it is sent to a worker (a request of the same document arriving meanwhile finds it), and
  on the decode worker at a KV handoff (it now holds the prompt);
* prompt + output when a request finishes or is cancelled on a worker (it keeps that sequence cached);
* nothing of a worker that died: its index is cleared (its context is gone).

Aging: each index holds at most the worker's ``n_ctx`` distinct tokens (its cells, running and cached
together), the least recently used going first.  Correction from the worker's real reuse
(``PrefixReused``, read off the lifecycle's ``n_cached_tokens`` when the request ends): when a worker with
a prefix cache reused fewer tokens than routing expected (by ``MIN_PREFIX_GAIN_TOKENS`` or more), it had
aged out entries the index still held, so as many of the index's least recently used tokens are dropped
(sparing the sequence just ended).  ``PrefixReused`` also scores the index: the gate sums expected and
reused tokens of ended requests (``AdmissionSnapshot.route_predicted_cached_tokens`` / ``route_reused_tokens``).  A worker whose cache reports mode
"off" (e.g. a sliding-window model) holds nothing reusable: it is never credited with a prefix.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from homepd.core.lifecycle import Lifecycle
from homepd.core.terms import ReuseMode
from homepd.core.routeindex import RouteIndex
from homepd.core.routing import MIN_PREFIX_GAIN_TOKENS


class PrefixAffinity:
    def __init__(self):
        self.indexes: dict[str, RouteIndex] = {}
        self.n_corrected_tokens = 0  # tokens dropped because a worker reused less than expected

    def index(self, handle) -> RouteIndex:
        index = self.indexes.get(handle.role)
        if index is None:
            index = self.indexes[handle.role] = RouteIndex(handle.spec.n_ctx)
        return index

    def cached(self, handle, ids: Sequence[int]) -> int:
        """Prompt tokens of ``ids`` that ``handle``'s worker probably holds."""
        stats = handle.cache_stats
        if stats is not None and stats.mode is ReuseMode.OFF:
            return 0
        index = self.indexes.get(handle.role)
        # why at most all but one: a worker computes a prompt's last token whatever it holds (its logits)
        return min(index.match(ids), len(ids) - 1) if index is not None and ids else 0

    def holds(self, handle, ids: Sequence[int]) -> None:
        """``handle``'s worker holds (or is computing) ``ids`` now."""
        self.index(handle).insert(ids)

    def ended(self, handle, lc: Lifecycle, ids: Sequence[int], workers: Mapping) -> None:
        """A request ended on ``handle``'s worker, holding ``ids`` (prompt + output); its lifecycle says what
        routing expected (``route_cached_tokens``, on ``routed_to``) and what was reused.  ``workers``: the
        controller's handles by name."""
        self.holds(handle, ids)
        routed = workers.get(lc.routed_to) if lc.routed_to else None
        missed = lc.route_cached_tokens - lc.n_cached_tokens
        # why only a worker that reports a prefix cache: before it does, no reuse is reported and a miss
        # says nothing of what it holds; why not a few tokens: that is the worker's reuse granularity, not aging
        if routed is not None and missed >= MIN_PREFIX_GAIN_TOKENS and routed.cache_stats is not None \
                and routed.cache_stats.mode is not ReuseMode.OFF and routed.role in self.indexes:
            index = self.indexes[routed.role]
            before = len(index)
            index.evict_tokens(missed, keep=ids)
            self.n_corrected_tokens += before - len(index)

    def forget(self, handle) -> None:
        """The worker died: what it held is gone."""
        index = self.indexes.get(handle.role)
        if index is not None:
            index.clear()
