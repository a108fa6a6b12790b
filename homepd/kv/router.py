"""Controller side of disaggregation: the KV arena, where a request is prefilled, and the requests in transit.

The controller owns the arena (creates, pre-faults, unlinks); the prefill
worker allocates extents in it.  A request is "in the arena" from the prefill
worker's ``KVHandoff`` until the decode worker's ``KVImported`` (or its end).

At admission ``fits_prefill_worker`` says whether a prompt can be prefilled on
the prefill worker: its KV fits both the prefill worker's context and the arena
(else the topology sends it to the decode worker itself, colocated-style, so it
never waits for room that cannot come).  After any worker death ``recover``
puts the extents of the requests in transit back in order and names those the
restarted decode worker can import without a second prefill; a restarted
prefill worker rebuilds its allocator from ``live_extents``.
"""
from __future__ import annotations

from collections import deque

from homepd.core.modes import Role
from homepd.core.protocol import AttachExtents, KVHandoff, WorkerReady
from homepd.core.records import KVArenaSnapshot
from homepd.kv.header import ExtentState
from homepd.kv.pool import KVArena, extent_bytes_for

MAX_USAGE_SAMPLES = 10_000
ARENA_SLACK_BYTES = 1 << 20  # default arena: the prefill context's KV state plus this, in whole MiB


class KVRouter:
    """The arena of ``arena_bytes`` and the bookkeeping of the requests that cross it."""

    def __init__(self, arena_bytes: int | None, prefill_ready: WorkerReady, prefill_n_ctx: int | None = None,
                 max_extents: int | None = None):
        """``arena_bytes`` None: room for the prefill worker's whole context (measured state bytes);
        ``prefill_n_ctx`` None: the prefill worker's own, from its ``WorkerReady``."""
        prefill_n_ctx = prefill_ready.n_ctx if prefill_n_ctx is None else prefill_n_ctx
        if arena_bytes is None:
            state = prefill_ready.state_overhead_bytes + prefill_ready.state_bytes_per_token * prefill_n_ctx
            arena_bytes = -(-(state + ARENA_SLACK_BYTES) // ARENA_SLACK_BYTES) * ARENA_SLACK_BYTES
        self.arena = KVArena.create(arena_bytes)
        self.state_bytes_per_token = prefill_ready.state_bytes_per_token
        self.state_overhead_bytes = prefill_ready.state_overhead_bytes
        self.prefill_n_ctx = prefill_n_ctx
        self.max_extents = max_extents
        self.in_arena: dict[str, KVHandoff] = {}
        # (t_s, arena bytes in use, KV payload bytes in transit) as the prefill worker's allocator saw them
        self.usage: deque[tuple[float, int, int]] = deque(maxlen=MAX_USAGE_SAMPLES)

    def attach_message(self) -> AttachExtents:
        """What a (re)started worker attaches to; a prefill worker also rebuilds its allocator from it."""
        return AttachExtents(self.arena.names, live_extents=self.live_extents(), max_extents=self.max_extents)

    def close(self) -> None:
        self.arena.close()  # the owner unlinks

    # admission --------------------------------------------------------------------
    def predicted_extent_bytes(self, n_tokens: int) -> int:
        """The arena bytes a sequence of ``n_tokens`` will take (state size is linear in the tokens; an upper
        bound for sliding-window models, whose state stops growing)."""
        return extent_bytes_for(self.state_overhead_bytes + self.state_bytes_per_token * n_tokens)

    def fits_prefill_worker(self, n_prompt_tokens: int) -> bool:
        """The prompt's KV fits the prefill worker's context and the arena (else the decode worker prefills
        it: the disaggregated topology's entry rule)."""
        fits_context = n_prompt_tokens <= self.prefill_n_ctx
        return fits_context and self.predicted_extent_bytes(n_prompt_tokens) <= self.arena.capacity_bytes

    # transit -------------------------------------------------------------------
    def handed_off(self, msg: KVHandoff) -> None:
        self.in_arena[msg.request_id] = msg
        self.usage.append((msg.export_end_s, msg.arena_used_bytes, msg.arena_kv_bytes))

    def imported(self, request_id: str) -> None:
        self.in_arena.pop(request_id, None)

    def drop(self, request_id: str) -> bool:
        """The request ended: if its KV still waits in the arena and nobody will import it, free it.

        Returns True if the request was in the arena (the prefill worker may have room now).
        """
        msg = self.in_arena.pop(request_id, None)
        if msg is None:
            return False
        if self._holds(msg) and self.arena.state(msg.offset) == ExtentState.READY:
            self.arena.reset_stale(msg.offset)
        return True

    def discard_export(self, msg: KVHandoff) -> None:
        """An export nobody wants (cancelled meanwhile): free its extent."""
        if self._holds(msg):
            self.arena.reset_stale(msg.offset)

    def _holds(self, msg: KVHandoff) -> bool:
        """The extent of ``msg`` still holds its request (not freed and overwritten by a later export)."""
        return self.arena.request_in(msg.offset) == msg.request_id

    def live_extents(self) -> tuple[tuple[int, int], ...]:
        """(offset, extent bytes) of every request in transit whose extent is intact and not yet freed."""
        return tuple(sorted((msg.offset, msg.extent_bytes) for msg in self.in_arena.values() if self._holds(msg)))

    def recover(self, role: str, dead_pid: int, resumable_ids: set[str]) -> list[str]:
        """Put the extents in transit back in order after ``dead_pid`` (a ``role`` worker) died.

        ``resumable_ids``: requests the dead decode worker held that are still wanted.
        Returns those whose KV is intact in the arena (to re-send to the restarted worker).

        What a dead prefill worker was writing, or published without its handoff
        reaching us, is in no request's extent: the restarted prefill worker's
        allocator (rebuilt from ``live_extents``) treats those bytes as free.
        """
        resumed = []
        for rid, msg in sorted(self.in_arena.items()):
            if not self._holds(msg):
                continue
            state, holder = self.arena.state(msg.offset), self.arena.holder_pid(msg.offset)
            if state == ExtentState.READING and holder == dead_pid:  # died mid-import
                self.arena.reset_stale(msg.offset, to=ExtentState.READY if rid in resumable_ids else ExtentState.FREE)
            if role == Role.DECODE and rid in resumable_ids and self.arena.state(msg.offset) == ExtentState.READY:
                resumed.append(rid)
        return resumed

    # figures ---------------------------------------------------------------------
    def snapshot(self) -> KVArenaSnapshot:
        """The arena and the requests in transit (their extents by state, the bytes those hold), for
        ``Engine.snapshot``."""
        occupancy = dict.fromkeys((state.name for state in ExtentState), 0)
        used_bytes = 0
        for msg in self.in_arena.values():
            if self._holds(msg):
                occupancy[self.arena.state(msg.offset).name] += 1
                used_bytes += msg.extent_bytes
        peak_used, peak_kv = self.peak_usage()
        return KVArenaSnapshot(capacity_bytes=self.arena.capacity_bytes, max_extents=self.max_extents,
                               occupancy=occupancy, in_arena=tuple(sorted(self.in_arena)), used_bytes=used_bytes,
                               in_transit_kv_bytes=self.in_transit_kv_bytes(), peak_used_bytes=peak_used,
                               peak_kv_bytes=peak_kv, prefill_n_ctx=self.prefill_n_ctx)

    def in_transit_kv_bytes(self) -> int:
        return sum(msg.n_bytes for msg in self.in_arena.values())

    def peak_usage(self, t0_s: float = float("-inf"), t1_s: float = float("inf")) -> tuple[int, int]:
        """(peak arena bytes in use, KV payload bytes in transit at that moment) between two monotonic times."""
        inside = [(used, kv) for t, used, kv in self.usage if t0_s <= t <= t1_s]
        return max(inside, default=(0, 0))
