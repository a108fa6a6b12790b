"""Controller-side arena bookkeeping: routing at admission, deaths and cancels (real shared memory, no model)."""
from __future__ import annotations

import os

import pytest

from homepd.core.protocol import KVHandoff, WorkerReady
from homepd.core.sampling import SamplingParams
from homepd.kv.header import HOLDER_PID_OFFSET, STATE_OFFSET, ExtentHeader, ExtentState
from homepd.kv.pool import DATA_OFFSET, extent_bytes_for
from homepd.kv.ring import RingAllocator

from homepd.core.modes import Mode
from homepd.engine.topology import topology_for
from homepd.kv.router import KVRouter

FP = "ab" * 32
DEAD_PID = 2 ** 22 + 12345  # beyond pid_max here: never a live process
READY = WorkerReady(1, "prefill", 0, 64, 0.0, state_bytes_per_token=100, state_overhead_bytes=1000)


@pytest.fixture
def router():
    r = KVRouter(arena_bytes=64 * 4096, prefill_ready=READY, prefill_n_ctx=64)
    r.ring = RingAllocator(r.arena.capacity_bytes)  # stands in for the prefill worker's allocator
    yield r
    r.close()


def publish(router, rid: str, n_bytes: int = 16, holder_pid: int | None = None) -> KVHandoff:
    """An export as the prefill worker makes it: allocate, begin, write, publish; the handoff message."""
    arena, extent = router.arena, extent_bytes_for(n_bytes)
    offset = router.ring.alloc(extent)
    arena.begin(offset, extent)
    arena.payload(offset, n_bytes, rid)[:] = bytes(i % 256 for i in range(n_bytes))
    arena.publish(offset, ExtentHeader(rid, FP, 64, 4, n_bytes))
    if holder_pid is not None:  # pretend another process touched it last
        set_state(router, offset, ExtentState.READY, holder_pid)
    return KVHandoff(rid, offset, (1, 2, 3, 4), (5,), SamplingParams(), None, n_bytes, 4, 0.0, 0.0, 0.0,
                     extent_bytes=extent, arena_used_bytes=router.ring.used_bytes, arena_kv_bytes=n_bytes)


def set_state(router, offset: int, state: ExtentState, holder_pid: int) -> None:
    """What a worker that died holding the extent leaves behind."""
    at = DATA_OFFSET + offset
    router.arena._buf[at + STATE_OFFSET] = state
    router.arena._buf[at + HOLDER_PID_OFFSET:at + HOLDER_PID_OFFSET + 4] = holder_pid.to_bytes(4, "little")


def reclaim(router) -> None:
    """What the prefill worker does before allocating: free what the state bytes say is free."""
    for offset in router.ring.live:
        if router.arena.state(offset) not in (ExtentState.WRITING, ExtentState.READY, ExtentState.READING):
            router.ring.free(offset)


def entry(router: KVRouter, n_tokens: int) -> str:
    """The worker the disaggregated topology sends a new prompt of ``n_tokens`` to, with this router."""
    return topology_for(Mode.DISAGGREGATED).entry_worker({"prefill": "prefill", "decode": "decode"}, router, n_tokens)


def test_route_sends_prompts_whose_kv_cannot_fit_the_prefill_context_or_the_arena_to_decode():
    small_arena = KVRouter(arena_bytes=3 * 4096, prefill_ready=READY, prefill_n_ctx=1000)
    try:
        assert small_arena.predicted_extent_bytes(10) == extent_bytes_for(1000 + 100 * 10) == 2 * 4096
        assert small_arena.fits_prefill_worker(10) and entry(small_arena, 10) == "prefill"
        assert entry(small_arena, 100) == "decode"       # 11 000 bytes of KV: more than the 12 KiB arena holds
    finally:
        small_arena.close()
    big_arena = KVRouter(arena_bytes=1 << 20, prefill_ready=READY, prefill_n_ctx=64)
    try:
        assert entry(big_arena, 64) == "prefill" and entry(big_arena, 65) == "decode"  # the prefill context
    finally:
        big_arena.close()


def test_default_arena_holds_the_prefill_workers_whole_context():
    r = KVRouter(arena_bytes=None, prefill_ready=READY, prefill_n_ctx=4096)
    try:
        assert r.arena.capacity_bytes >= r.predicted_extent_bytes(4096)
        assert r.fits_prefill_worker(4096)
    finally:
        r.close()


def test_decode_death_mid_import_puts_the_extent_back_to_ready_and_resumes(router):
    msg = publish(router, "a")
    router.handed_off(msg)
    set_state(router, msg.offset, ExtentState.READING, DEAD_PID)  # READING by the dead decode worker
    assert router.recover("decode", DEAD_PID, {"a"}) == ["a"]
    assert router.arena.state(msg.offset) == ExtentState.READY
    assert router.live_extents() == ((msg.offset, msg.extent_bytes),)


def test_decode_death_after_release_does_not_resume_into_reused_bytes(router):
    msg = publish(router, "a", n_bytes=3 * 4096)
    router.handed_off(msg)
    router.arena.release(msg.offset)  # the decode worker freed it, then died before KVImported
    reclaim(router)
    router.ring.head = msg.offset + 4096   # the prefill worker's next export lands inside a's old extent
    other = publish(router, "b")
    assert msg.offset < other.offset < msg.offset + msg.extent_bytes
    assert router.recover("decode", DEAD_PID, {"a"}) == []
    assert router.arena.request_in(other.offset) == "b" and router.arena.state(other.offset) == ExtentState.READY
    assert router.live_extents() == ()  # b's handoff has not reached the router yet; a's bytes are b's


def test_cancelled_request_in_the_arena_is_not_resumed_and_its_extent_frees(router):
    msg = publish(router, "a")
    router.handed_off(msg)
    set_state(router, msg.offset, ExtentState.READING, DEAD_PID)
    assert router.recover("decode", DEAD_PID, set()) == []   # not wanted any more
    assert router.arena.state(msg.offset) == ExtentState.FREE


def test_prefill_death_leaves_only_known_handoffs_live(router):
    half = publish(router, "half")
    set_state(router, half.offset, ExtentState.WRITING, DEAD_PID)  # WRITING by the dead prefill worker
    orphan = publish(router, "o")                               # READY, but its KVHandoff never arrived
    kept = publish(router, "k")
    router.handed_off(kept)                                     # READY and known: the decode worker will import it
    assert router.recover("prefill", DEAD_PID, {"x"}) == []
    assert router.arena.state(kept.offset) == ExtentState.READY
    # the restarted prefill worker rebuilds its allocator from this: the rest is free space
    assert router.attach_message().live_extents == ((kept.offset, kept.extent_bytes),)
    fresh = RingAllocator(router.arena.capacity_bytes)
    for offset, n in router.attach_message().live_extents:
        fresh.reserve(offset, n)
    assert fresh.used_bytes == kept.extent_bytes and fresh.alloc(half.extent_bytes) == half.offset


def test_drop_frees_a_ready_extent_only_if_it_still_holds_that_request(router):
    a = publish(router, "a")
    router.handed_off(a)
    assert router.drop("a") is True          # e.g. cancelled while waiting in the decode backlog
    assert router.arena.state(a.offset) == ExtentState.FREE
    b = publish(router, "b")
    router.handed_off(b)
    router.arena.release(b.offset)             # the decode worker already freed it...
    reclaim(router)
    router.ring.head = b.offset
    c = publish(router, "c")                 # ...and prefill reused its bytes
    assert c.offset == b.offset
    assert router.drop("b") is True
    assert router.arena.request_in(c.offset) == "c" and router.arena.state(c.offset) == ExtentState.READY
    assert router.drop("nobody") is False
    assert os.getpid() == router.arena.owner_pid


def test_peak_usage_pairs_arena_bytes_with_the_kv_in_transit_then(router):
    msgs = [publish(router, f"r{i}", n_bytes=5000 * (i + 1)) for i in range(3)]
    for i, msg in enumerate(msgs):
        router.handed_off(KVHandoff(**{**msg.__dict__, "export_end_s": float(i)}))
    assert router.peak_usage() == (msgs[2].arena_used_bytes, msgs[2].arena_kv_bytes)
    assert router.peak_usage(0.0, 1.0) == (msgs[1].arena_used_bytes, msgs[1].arena_kv_bytes)
    snap = router.snapshot()
    assert snap.peak_used_bytes == msgs[2].arena_used_bytes and snap.occupancy["READY"] == 3
    assert snap.in_transit_kv_bytes == 5000 + 10000 + 15000 and snap.capacity_bytes == 64 * 4096


def test_the_snapshot_counts_extents_and_the_bytes_they_hold(router):
    msgs = [publish(router, f"r{i}", n_bytes=5000 * (i + 1)) for i in range(3)]
    for msg in msgs:
        router.handed_off(msg)
    set_state(router, msgs[0].offset, ExtentState.READING, os.getpid())  # the decode worker reads the first
    router.imported("r2")                  # the third is in the decode worker already
    snap = router.snapshot()
    assert snap.in_arena == ("r0", "r1") and snap.n_extents == 2
    assert {k: v for k, v in snap.occupancy.items() if v} == {"READING": 1, "READY": 1}
    assert snap.used_bytes == msgs[0].extent_bytes + msgs[1].extent_bytes
    assert snap.in_transit_kv_bytes == 5000 + 10000 and snap.max_extents is None
