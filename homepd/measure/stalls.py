"""Stall attribution: for every inter-token gap over the target, which prompt caused it, for how long.

From recorded data only (lifecycles and the step log).  A request's token
``i`` is produced by the step that ends at ``token_times_s[i]``; the gap
before it is ``(token_times_s[i-1], token_times_s[i]]``.  Every step of the
request's own worker that ran in the gap and carried prompt tokens holds it
(colocated: a chunk computed in the same ``llama_decode``).  In disaggregated
mode the decode worker's steps carry no prompt tokens; the prefill worker's
steps that overlap the gap are named instead, as concurrent contenders.  A
step the policy granted past the ITL budget to a prompt's TTFT deadline
(``StepRecord.granted_to``) says so: that gap was chosen, not suffered; and
so does one run at the gap ceiling for a prompt whose deadline was lost
anyway (``StepRecord.grant_lost``).  The KV store's saves and restores run between two steps
(``StepRecord.store_ms``, before the step that records them), and a stream waits for them as for a step: a
gap says how much of it they took.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from homepd.core.lifecycle import Lifecycle
from homepd.core.modes import Role
from homepd.core.protocol import StepRecord


@dataclass(frozen=True)
class Culprit:
    request_id: str          # the prompt being prefilled
    n_prompt_tokens: int     # of its tokens computed during the gap
    held_ms: float           # time of the steps (in the gap) that carried them
    same_step: bool          # True: computed in the stalled stream's own steps; False: a concurrent worker
    deadline_grant: bool = False  # a step of them ran past the ITL budget so that this prompt kept its TTFT
    deadline_lost: bool = False   # ... or, its TTFT lost anyway, at the gap ceiling (steppolicy.lost_grant)

    @property
    def grant_note(self) -> str:
        """', granted to its deadline' or ', at the gap ceiling, its deadline lost' when a step of its was chosen
        past the ITL budget for it; '' otherwise (the app's stall text and the run report both say it)."""
        if self.deadline_grant:
            return ", granted to its deadline"
        return ", at the gap ceiling, its deadline lost" if self.deadline_lost else ""


@dataclass(frozen=True)
class Stall:
    request_id: str          # the stream that waited
    token_index: int         # the token that came late
    gap_ms: float
    culprits: tuple[Culprit, ...]
    store_ms: float = 0.0    # the KV store's saves and restores between its worker's steps in the gap

    @property
    def worst(self) -> Culprit | None:
        return max(self.culprits, key=lambda c: c.held_ms, default=None)


@dataclass(frozen=True)
class Gap:
    """One inter-token gap of a stream: token ``token_index`` came at ``t_s``, the one before at ``t_prev_s``."""
    token_index: int
    t_prev_s: float
    t_s: float

    @property
    def gap_ms(self) -> float:
        return (self.t_s - self.t_prev_s) * 1e3


def gaps_over(token_times_s: list[float], itl_target_ms: float, limit: int | None = None) -> list[Gap]:
    """The gaps of ``token_times_s`` above ``itl_target_ms``, largest first (the ``limit`` largest, when given)."""
    gaps = [Gap(i, token_times_s[i - 1], token_times_s[i]) for i in range(1, len(token_times_s))
            if (token_times_s[i] - token_times_s[i - 1]) * 1e3 > itl_target_ms]
    gaps.sort(key=lambda g: -g.gap_ms)
    return gaps if limit is None else gaps[:limit]


def attribute_stalls(records: list[Lifecycle], steps: list[StepRecord], itl_target_ms: float) -> list[Stall]:
    """Every gap above ``itl_target_ms`` in ``records``, with the prompts that held it; largest gap first."""
    return attribute_gaps([(lc.request_id, gaps_over(lc.token_times_s, itl_target_ms)) for lc in records], steps)


def attribute_gaps(gaps_by_request: list[tuple[str, list[Gap]]], steps: list[StepRecord]) -> list[Stall]:
    """``attribute_stalls`` for gaps already picked out (``gaps_over``), per request id: the prompts whose steps
    held each; largest gap first."""
    by_role: dict[str, list[StepRecord]] = {}
    for s in sorted(steps, key=lambda s: s.t_start_s):
        by_role.setdefault(s.worker_role, []).append(s)
    ends = {role: [s.t_end_s for s in ss] for role, ss in by_role.items()}
    out = []
    for request_id, gaps in gaps_by_request:
        for g in gaps:
            own = _role_of(by_role, ends, request_id, g.t_s)
            culprits = _in_gap(by_role, ends, own, request_id, g.t_prev_s, g.t_s)
            store_ms = _store_in_gap(by_role, ends, own, g.t_prev_s, g.t_s)
            out.append(Stall(request_id, g.token_index, g.gap_ms, tuple(culprits), store_ms))
    out.sort(key=lambda st: -st.gap_ms)
    return out


def _in_gap(by_role, ends, own: str | None, request_id: str, t0: float, t1: float) -> list[Culprit]:
    """The prompts computed in the gap (t0, t1] of ``request_id``, whose token came from worker ``own``."""
    held: dict[tuple[str, bool], list] = {}
    granted: set[str] = set()
    lost: set[str] = set()
    for role, ss in by_role.items():
        same_step = role == own
        if not same_step and role != Role.PREFILL:
            continue  # another replica's steps do not hold this stream
        i = bisect.bisect_right(ends[role], t0)
        while i < len(ss) and ss[i].t_start_s < t1:
            s = ss[i]
            i += 1
            overlap_ms = (min(s.t_end_s, t1) - max(s.t_start_s, t0)) * 1e3
            if overlap_ms <= 0:
                continue
            if s.granted_to is not None and s.granted_to != request_id:
                (lost if s.grant_lost else granted).add(s.granted_to)
            for rid, n in s.prefill:
                if rid == request_id:
                    continue  # its own prompt (a resume by recompute): not someone else's stall
                acc = held.setdefault((rid, same_step), [0, 0.0])
                acc[0] += n
                acc[1] += overlap_ms
    return sorted((Culprit(rid, int(n), ms, same, rid in granted, rid in lost)
                   for (rid, same), (n, ms) in held.items()),
                  key=lambda c: -c.held_ms)


def _store_in_gap(by_role, ends, own: str | None, t0: float, t1: float) -> float:
    """The KV store's time on the stream's own worker ``own`` between ``t0`` and ``t1``: the ``store_ms`` of the
    steps that started in the gap (their saves and restores ran just before them), at most the gap."""
    if own is None:
        return 0.0
    ss = by_role[own]
    i = bisect.bisect_right(ends[own], t0)
    ms = 0.0
    while i < len(ss) and ss[i].t_start_s <= t1:
        if ss[i].t_start_s > t0:
            ms += ss[i].store_ms
        i += 1
    return min(ms, (t1 - t0) * 1e3)


def _role_of(by_role, ends, request_id: str, t_token: float) -> str | None:
    """The worker whose step produced the token at ``t_token`` for ``request_id``."""
    for role, ss in by_role.items():
        i = bisect.bisect_left(ends[role], t_token - 1e-9)
        if i < len(ss) and abs(ss[i].t_end_s - t_token) < 1e-6 and (
                request_id in ss[i].decode_request_ids or any(rid == request_id for rid, _ in ss[i].prefill)):
            return role
    return None
