"""Stall attribution: for every inter-token gap over the target, which prompt caused it, for how long.

From recorded data only (lifecycles and the step log).  A request's token
``i`` is produced by the step that ends at ``token_times_s[i]``; the gap
before it is ``(token_times_s[i-1], token_times_s[i]]``.  Every step of the
request's own worker that ran in the gap and carried prompt tokens holds it
(colocated: a chunk computed in the same ``llama_decode``).  In disaggregated
mode the decode worker's steps carry no prompt tokens; the prefill worker's
steps that overlap the gap are named instead, as concurrent contenders.
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


@dataclass(frozen=True)
class Stall:
    request_id: str          # the stream that waited
    token_index: int         # the token that came late
    gap_ms: float
    culprits: tuple[Culprit, ...]

    @property
    def worst(self) -> Culprit | None:
        return max(self.culprits, key=lambda c: c.held_ms, default=None)


def attribute_stalls(records: list[Lifecycle], steps: list[StepRecord], itl_target_ms: float) -> list[Stall]:
    """Every gap above ``itl_target_ms`` in ``records``, with the prompts that held it; largest gap first."""
    by_role: dict[str, list[StepRecord]] = {}
    for s in sorted(steps, key=lambda s: s.t_start_s):
        by_role.setdefault(s.worker_role, []).append(s)
    ends = {role: [s.t_end_s for s in ss] for role, ss in by_role.items()}
    out = []
    for lc in records:
        times = lc.token_times_s
        for i in range(1, len(times)):
            gap_ms = (times[i] - times[i - 1]) * 1e3
            if gap_ms <= itl_target_ms:
                continue
            culprits = _in_gap(by_role, ends, lc.request_id, times[i - 1], times[i])
            out.append(Stall(lc.request_id, i, gap_ms, tuple(culprits)))
    out.sort(key=lambda st: -st.gap_ms)
    return out


def _in_gap(by_role, ends, request_id: str, t0: float, t1: float) -> list[Culprit]:
    own = _role_of(by_role, ends, request_id, t1)
    held: dict[tuple[str, bool], list] = {}
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
            for rid, n in s.prefill:
                if rid == request_id:
                    continue  # its own prompt (a resume by recompute): not someone else's stall
                acc = held.setdefault((rid, same_step), [0, 0.0])
                acc[0] += n
                acc[1] += overlap_ms
    return sorted((Culprit(rid, int(n), ms, same) for (rid, same), (n, ms) in held.items()),
                  key=lambda c: -c.held_ms)


def _role_of(by_role, ends, request_id: str, t_token: float) -> str | None:
    """The worker whose step produced the token at ``t_token`` for ``request_id``."""
    for role, ss in by_role.items():
        i = bisect.bisect_left(ends[role], t_token - 1e-9)
        if i < len(ss) and abs(ss[i].t_end_s - t_token) < 1e-6 and (
                request_id in ss[i].decode_request_ids or any(rid == request_id for rid, _ in ss[i].prefill)):
            return role
    return None
