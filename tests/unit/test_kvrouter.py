"""Controller-side slot bookkeeping after deaths and cancels (real shared memory, no model)."""
from __future__ import annotations

import os

import pytest

from homepd.kv.router import KVRouter
from homepd.kv.header import HOLDER_PID_OFFSET, STATE_OFFSET, SlotHeader, SlotState
from homepd.core.protocol import KVHandoff, WorkerReady
from homepd.core.sampling import SamplingParams

FP = "ab" * 32
DEAD_PID = 2 ** 22 + 12345  # beyond pid_max here: never a live process


@pytest.fixture
def router():
    r = KVRouter(n_slots=3, n_ctx=64, prefill_ready=WorkerReady(1, "prefill", 0, 64, 0.0, 100, 1000))
    yield r
    r.close()


def publish(router, rid: str, holder_pid: int | None = None) -> KVHandoff:
    pool = router.pool
    slot = pool.acquire_free()
    pool.payload(slot, 16, rid)[:] = bytes(range(16))
    pool.publish(slot, SlotHeader(rid, FP, 64, 4, 16))
    if holder_pid is not None:  # pretend another process touched it last
        pool._bufs[slot][HOLDER_PID_OFFSET:HOLDER_PID_OFFSET + 4] = holder_pid.to_bytes(4, "little")
    return KVHandoff(rid, slot, (1, 2, 3, 4), (5,), SamplingParams(), None, None, 16, 4, 0.0, 0.0, 0.0)


def set_state(router, slot: int, state: SlotState, holder_pid: int) -> None:
    """What a worker that died holding the slot leaves behind."""
    router.pool._bufs[slot][STATE_OFFSET] = state
    router.pool._bufs[slot][HOLDER_PID_OFFSET:HOLDER_PID_OFFSET + 4] = holder_pid.to_bytes(4, "little")


def test_decode_death_mid_import_puts_slot_back_to_ready_and_resumes(router):
    msg = publish(router, "a")
    router.handed_off(msg)
    set_state(router, msg.slot, SlotState.READING, DEAD_PID)  # READING by the dead decode worker
    assert router.recover("decode", DEAD_PID, {"a"}) == ["a"]
    assert router.pool.state(msg.slot).name == "READY"


def test_decode_death_after_release_does_not_resume_into_a_reused_slot(router):
    msg = publish(router, "a")
    router.handed_off(msg)
    router.pool.release(msg.slot)  # the decode worker freed it, then died before KVImported
    other = publish(router, "b")    # prefill reused the same slot for another request
    assert other.slot == msg.slot
    assert router.recover("decode", DEAD_PID, {"a"}) == []
    assert router.pool.request_in(msg.slot) == "b" and router.pool.state(msg.slot).name == "READY"


def test_cancelled_request_in_a_slot_is_not_resumed_and_its_slot_frees(router):
    msg = publish(router, "a")
    router.handed_off(msg)
    set_state(router, msg.slot, SlotState.READING, DEAD_PID)
    assert router.recover("decode", DEAD_PID, set()) == []   # not wanted any more
    assert router.pool.state(msg.slot).name == "FREE"


def test_prefill_death_frees_half_written_and_orphaned_slots(router):
    half = router.pool.acquire_free()
    set_state(router, half, SlotState.WRITING, DEAD_PID)                      # WRITING by the dead prefill worker
    orphan = publish(router, "o")                              # READY, but its KVHandoff never arrived
    kept = publish(router, "k")
    router.handed_off(kept)                                    # READY and known: the decode worker will import it
    assert router.recover("prefill", DEAD_PID, {"x"}) == []
    assert router.pool.state(half).name == "FREE"
    assert router.pool.state(orphan.slot).name == "FREE"
    assert router.pool.state(kept.slot).name == "READY"


def test_drop_frees_a_ready_slot_only_if_it_still_holds_that_request(router):
    a = publish(router, "a")
    router.handed_off(a)
    assert router.drop("a") is True          # e.g. cancelled while waiting in the decode backlog
    assert router.pool.state(a.slot).name == "FREE"
    b = publish(router, "b")
    router.handed_off(b)
    router.pool.release(b.slot)              # the decode worker already freed it...
    c = publish(router, "c")                 # ...and prefill reused it
    assert router.drop("b") is True
    assert router.pool.request_in(c.slot) == "c" and router.pool.state(c.slot).name == "READY"
    assert router.drop("nobody") is False
    assert os.getpid() == router.pool.owner_pid
