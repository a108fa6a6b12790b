"""Cache-aware routing among replicas, and why a request went where.  Pure policy.

A replica that probably holds a long prefix of the prompt (``homepd.core.routeindex``) computes only the
rest, so it gives the first token sooner and keeps the others' cells free.  The request goes there, unless
that replica's queue would break the request's TTFT budget and another replica would give it sooner; then
(and when no replica holds much more of it than every replica does) it goes to the least loaded.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

# why: a replica must hold this many more tokens of the prompt than the least loaded one to pull the request
# to itself; a few tokens (a chat template's head, which every replica holds) are not worth unbalancing for
MIN_PREFIX_GAIN_TOKENS = 16


class RouteReason(str, enum.Enum):
    """Why a request entered the worker it entered (``AdmissionSnapshot.routed_by_reason``, the lifecycle)."""
    SOLE = "sole"                  # one worker could take it (colocated; a prompt only the decode worker fits)
    PREFIX_HIT = "prefix_hit"      # the worker probably holding its longest prefix
    LEAST_LOADED = "least_loaded"  # no worker holds enough more of it: the least loaded
    TTFT_BUDGET = "ttft_budget"    # the prefix holder's queue would break its TTFT budget: the least loaded
    SOONER = "sooner"              # disaggregated: the side predicted sooner on its uncached tokens

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReplicaView:
    """One usable replica as routing sees it."""
    name: str
    n_cached_tokens: int                 # of this prompt, probably held there
    load_rank: tuple                     # smaller: less loaded (requests in flight, then not ready, then name)
    predicted_ttft_ms: float | None      # on its uncached tokens behind its queue; None: its speed unmeasured


@dataclass(frozen=True)
class ReplicaChoice:
    name: str
    reason: RouteReason
    n_cached_tokens: int


def choose_replica(replicas: list[ReplicaView], ttft_budget_ms: float) -> ReplicaChoice:
    """The replica a new request enters (``replicas``: the usable ones, at least one)."""
    assert replicas
    least = min(replicas, key=lambda r: r.load_rank)
    best = max(r.n_cached_tokens for r in replicas)
    if best - min(r.n_cached_tokens for r in replicas) < MIN_PREFIX_GAIN_TOKENS:  # what they all hold
        return ReplicaChoice(least.name, RouteReason.LEAST_LOADED, least.n_cached_tokens)
    # the least loaded of those holding about the longest prefix (within the gain that is not worth a move)
    holder = min((r for r in replicas if r.n_cached_tokens > best - MIN_PREFIX_GAIN_TOKENS),
                 key=lambda r: r.load_rank)
    breaks = holder.predicted_ttft_ms is not None and holder.predicted_ttft_ms > ttft_budget_ms
    # why also "sooner there": when every replica would miss the budget, moving the request only adds work
    if holder is not least and breaks and (least.predicted_ttft_ms is None
                                           or least.predicted_ttft_ms < holder.predicted_ttft_ms):
        return ReplicaChoice(least.name, RouteReason.TTFT_BUDGET, least.n_cached_tokens)
    return ReplicaChoice(holder.name, RouteReason.PREFIX_HIT, holder.n_cached_tokens)
