"""KV slot pool: real shared memory, real processes where ownership matters, no sleeps."""
from __future__ import annotations

import ctypes
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from homepd.errors import SlotError
from homepd.kv.header import HEADER_BYTES, SlotState, payload_checksum
from homepd.kv.segment import (SHM_DIR, attach_segment, cleanup_stale_segments, parse_segment_name,
                                   unlink_pool_of)
from homepd.kv.pool import SlotExpectation, SlotHeader, SlotPool

FP_A = hashlib.sha256(b"model a").hexdigest()
FP_B = hashlib.sha256(b"model b").hexdigest()
N_CTX = 4096
CAPACITY = 1 << 20


@pytest.fixture
def pool():
    with SlotPool.create(3, CAPACITY, verify="full") as pool:
        yield pool


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def publish(pool: SlotPool, data: bytes, request_id: str = "req-1", fingerprint: str = FP_A,
            n_ctx: int = N_CTX) -> int:
    slot = pool.acquire_free()
    assert slot is not None
    pool.payload(slot, len(data), request_id)[:] = data
    pool.publish(slot, SlotHeader(request_id, fingerprint, n_ctx, n_tokens=17, payload_bytes=len(data)))
    return slot


def expect(request_id: str = "req-1", fingerprint: str = FP_A, n_ctx: int = N_CTX) -> SlotExpectation:
    return SlotExpectation(request_id, fingerprint, n_ctx)


def in_shm(pool: SlotPool) -> list[str]:
    prefix = f"homepd-kv-{pool.owner_pid}-{pool.token}-"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


PRELUDE = """
import json, os, sys, hashlib
from homepd.kv.pool import SlotPool, SlotExpectation, SlotHeader
def recv(): return json.loads(sys.stdin.readline())
def send(**m): print(json.dumps(m), flush=True)
"""


class Child:
    """``python -c code`` with line-based JSON over stdin/stdout: the synchronisation."""

    def __init__(self, body: str, prelude: str = ""):
        code = PRELUDE + prelude + textwrap.dedent(body)
        self.process = subprocess.Popen([sys.executable, "-c", code], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, **message) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def recv(self) -> dict:
        line = self.process.stdout.readline()
        assert line, f"child exited with {self.process.wait()} before answering"
        return json.loads(line)

    def wait(self) -> int:
        self.process.stdin.close()
        self.process.stdout.close()
        return self.process.wait(timeout=30)




def test_round_trip_through_another_process(pool):
    data = random_bytes(300_001, seed=1)
    slot = publish(pool, data, request_id="req-λ")  # non-ascii id, odd length
    child = Child("""
    m = recv()
    pool = SlotPool.attach(m["names"], verify="full")
    header, view = pool.open_ready(m["slot"], SlotExpectation("req-λ", m["fp"], m["n_ctx"]))
    send(sha=hashlib.sha256(view).hexdigest(), n_tokens=header.n_tokens, state=pool.states()[m["slot"]])
    reply = hashlib.sha256(view).digest() * 1000
    pool.release(m["slot"])  # releases view too
    out = pool.acquire_free()
    pool.payload(out, len(reply))[:] = reply
    pool.publish(out, SlotHeader("reply", m["fp"], m["n_ctx"], 1, len(reply)))
    send(slot=out, pid=os.getpid())
    pool.close()
    """)
    child.send(names=list(pool.names), slot=slot, fp=FP_A, n_ctx=N_CTX)
    seen = child.recv()
    assert seen == {"sha": hashlib.sha256(data).hexdigest(), "n_tokens": 17, "state": "READING"}
    answer = child.recv()
    assert child.wait() == 0
    assert answer["slot"] == slot  # released by the child, then the first free one again
    assert pool.holder_pid(slot) == answer["pid"]
    header, view = pool.open_ready(slot, expect("reply"))
    assert bytes(view) == hashlib.sha256(data).digest() * 1000
    assert pool.holder_pid(slot) == os.getpid()
    assert header.verify == "full" and header.published_s > 0
    pool.release(slot)
    assert pool.occupancy() == {"FREE": 3, "WRITING": 0, "READY": 0, "READING": 0}


def test_payload_views_take_ctypes_like_state_get_and_set(pool):
    data = random_bytes(4096 * 3 + 5, seed=2)
    slot = pool.acquire_free()
    view = pool.payload(slot, len(data))
    dst = (ctypes.c_uint8 * len(data)).from_buffer(view)  # what LlamaContext.state_get does
    ctypes.memmove(dst, data, len(data))
    del dst
    pool.publish(slot, SlotHeader("req-1", FP_A, N_CTX, 3, len(data)))
    with pytest.raises(ValueError):
        view[0] = 1  # released at publish: no writes after hand-over
    _, payload = pool.open_ready(slot, expect())
    src = (ctypes.c_uint8 * len(data)).from_buffer(payload)  # what state_set does
    assert bytes(src) == data
    del src


@pytest.mark.parametrize("offset", [0, 1, 4095, 65_536, 300_000, 300_002])
def test_corrupted_payload_byte_is_caught(pool, offset):
    slot = publish(pool, random_bytes(300_003, seed=3))
    raw = attach_segment(pool.names[slot])
    raw[HEADER_BYTES + offset] ^= 0x01
    raw.close()
    with pytest.raises(SlotError, match="payload checksum mismatch"):
        pool.open_ready(slot, expect())
    assert pool.state(slot) == SlotState.READY  # left for the owner to decide


def test_sampled_checksum_catches_edges_and_sampled_lines():
    with SlotPool.create(1, 4 << 20, verify="sampled") as pool:
        n = (4 << 20) - 12_345
        for offset in (7, n - 3, 65_536 + 5 * 4096 + 5 * 64 + 3):  # head, tail, page 5's sampled line
            slot = publish(pool, random_bytes(n, seed=offset))
            raw = attach_segment(pool.names[slot])
            raw[HEADER_BYTES + offset] ^= 0x80
            raw.close()
            with pytest.raises(SlotError, match=r"checksum mismatch .*\(sampled check\)"):
                pool.open_ready(slot, expect())
            pool.release(slot)


@pytest.mark.parametrize("verify", ["full", "sampled"])
def test_checksum_sees_length_and_every_single_byte(verify):
    data = bytearray(3 * 65_536 + 4096 * 64 * 2 + 11)  # zeros: truncation must still show
    n = len(data)
    base = payload_checksum(data, n, verify)
    assert base == payload_checksum(bytes(data), n, verify)
    for shorter in (n - 1, n - 8, n - 4096, 0):
        assert payload_checksum(data, shorter, verify) != base
    if verify == "full":
        for offset in range(0, n, 997):
            data[offset] = 0xFF
            assert payload_checksum(data, n, verify) != base, offset
            data[offset] = 0


@pytest.mark.parametrize("field, bad, message", [
    ("fingerprint", FP_B, r"model fingerprint .*this decode worker runs .*same GGUF"),
    ("n_ctx", 2048, r"n_ctx 4096, this decode worker runs n_ctx 2048"),
    ("request_id", "req-2", r"request id 'req-1', expected 'req-2'"),
])
def test_mismatched_expectation_names_the_field(pool, field, bad, message):
    slot = publish(pool, random_bytes(1000))
    with pytest.raises(SlotError, match=message):
        pool.open_ready(slot, expect(**{field: bad}))
    assert pool.state(slot) == SlotState.READY
    pool.open_ready(slot, expect())  # the right consumer still gets it


def test_corrupted_header_is_caught(pool):
    slot = publish(pool, random_bytes(1000))
    raw = attach_segment(pool.names[slot])
    raw[40] ^= 0x01  # inside the body: n_ctx / payload size area
    raw.close()
    with pytest.raises(SlotError, match="header checksum mismatch"):
        pool.open_ready(slot, expect())


def test_payload_over_capacity_says_what_to_do(pool):
    slot = pool.acquire_free()
    with pytest.raises(SlotError, match=r"'req-9' needs 1048577 bytes.*holds 1048576.*capacity for the full n_ctx"):
        pool.payload(slot, CAPACITY + 1, "req-9")
    with pytest.raises(SlotError, match="capacity"):
        pool.publish(slot, SlotHeader("req-9", FP_A, N_CTX, 1, CAPACITY + 1))


def test_bad_header_fields_are_refused(pool):
    slot = pool.acquire_free()
    with pytest.raises(SlotError, match="at most 64"):
        pool.publish(slot, SlotHeader("x" * 65, FP_A, N_CTX, 1, 10))
    with pytest.raises(SlotError, match="not a hex sha256"):
        pool.publish(slot, SlotHeader("r", "abc", N_CTX, 1, 10))
    assert pool.state(slot) == SlotState.WRITING


def test_exhaustion_is_back_pressure_not_an_error(pool):
    slots = [pool.acquire_free() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert pool.acquire_free() is None
    assert pool.occupancy()["WRITING"] == 3
    pool.release(slots[1])
    assert pool.acquire_free() == slots[1]
    assert pool.acquire_free() is None


def test_wrong_state_transitions_are_refused(pool):
    slot = publish(pool, random_bytes(100))
    with pytest.raises(SlotError, match="is READY, expected WRITING"):
        pool.payload(slot, 10)
    pool.open_ready(slot, expect())
    with pytest.raises(SlotError, match="is READING, expected READY"):
        pool.open_ready(slot, expect())
    pool.release(slot)
    with pytest.raises(SlotError, match="released twice"):
        pool.release(slot)


@pytest.mark.parametrize("how", ["return", "os._exit", "SIGKILL"])
def test_attacher_exit_leaves_owner_segments(pool, how):
    data = random_bytes(5000, seed=4)
    slot = publish(pool, data)
    child = Child("""
    m = recv()
    pool = SlotPool.attach(m["names"])
    pool.states()
    send(attached=True)
    if m["how"] == "os._exit":
        os._exit(0)
    if m["how"] == "SIGKILL":
        recv()  # blocks until killed
    """)
    child.send(names=list(pool.names), how=how)
    assert child.recv() == {"attached": True}
    if how == "SIGKILL":
        child.process.send_signal(signal.SIGKILL)
    child.wait()
    assert in_shm(pool) == sorted(pool.names)
    _, view = pool.open_ready(slot, expect())
    assert bytes(view) == data


def test_owner_close_unlinks_even_with_a_live_export():
    pool = SlotPool.create(2, 8192)
    names = pool.names
    assert in_shm(pool) == sorted(names)
    slot = pool.acquire_free()
    held = (ctypes.c_uint8 * 10).from_buffer(pool.payload(slot, 10))  # a ctypes array still alive
    pool.close()
    pool.close()  # idempotent
    assert in_shm(pool) == []
    held[0] = 1  # the mapping lives until its export dies
    del held
    with pytest.raises(SlotError, match="closed pool"):
        pool.acquire_free()


def test_attacher_close_does_not_unlink(pool):
    with SlotPool.attach(list(pool.names)) as attached:
        assert attached.capacity_bytes == CAPACITY
        assert (attached.owner_pid, attached.token, attached.is_owner) == (os.getpid(), pool.token, False)
    assert in_shm(pool) == sorted(pool.names)


def test_owner_exiting_without_close_unlinks_at_exit():
    child = Child("""
    pool = SlotPool.create(2, 4096)
    send(names=list(pool.names))
    """)
    names = child.recv()["names"]
    assert child.wait() == 0
    assert not any((SHM_DIR / name).exists() for name in names)


def leak_a_pool() -> list[str]:
    """A child creates a pool and dies without cleaning up (os._exit): its pid is dead after wait()."""
    child = Child("""
    pool = SlotPool.create(2, 4096)
    send(names=list(pool.names))
    os._exit(0)
    """)
    names = child.recv()["names"]
    child.wait()
    assert all((SHM_DIR / name).exists() for name in names)
    return names


def test_cleanup_stale_segments_removes_dead_owners_only(pool):
    dead_names = leak_a_pool()
    removed = cleanup_stale_segments()
    assert set(dead_names) <= set(removed)
    assert not any((SHM_DIR / name).exists() for name in dead_names)
    assert in_shm(pool) == sorted(pool.names)  # live pool untouched
    assert all(parse_segment_name(name)[0] != os.getpid() for name in removed)


def test_worker_unlinks_pool_of_dead_controller():
    names = leak_a_pool()
    worker = SlotPool.attach(names)
    removed = unlink_pool_of(worker.owner_pid, worker.token)
    assert sorted(removed) == sorted(names)
    assert worker.states() == ["FREE", "FREE"]  # still mapped after unlink
    worker.close()


def test_dead_consumer_slot_goes_back_to_ready(pool):
    data = random_bytes(20_000, seed=5)
    slot = publish(pool, data)
    child = Child("""
    m = recv()
    pool = SlotPool.attach(m["names"])
    pool.open_ready(m["slot"], SlotExpectation("req-1", m["fp"], m["n_ctx"]))
    send(pid=os.getpid())
    recv()  # blocks until killed
    """)
    child.send(names=list(pool.names), slot=slot, fp=FP_A, n_ctx=N_CTX)
    pid = child.recv()["pid"]
    child.process.send_signal(signal.SIGKILL)
    child.wait()
    assert pool.slots_held_by(pid) == [slot]
    with pytest.raises(SlotError, match="only READING goes back to READY"):
        pool.reset_stale(pool.acquire_free(), SlotState.READY)
    pool.reset_stale(slot, SlotState.READY)
    _, view = pool.open_ready(slot, expect())
    assert bytes(view) == data


def mapped_rss_bytes(name: str) -> int:
    """Rss of this process's mapping of /dev/shm/<name>, from /proc/self/smaps."""
    in_mapping, rss_kb = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's first line
            in_mapping = line.rstrip().endswith(str(SHM_DIR / name))
        elif in_mapping and line.startswith("Rss:"):
            rss_kb += int(line.split()[1])
    return rss_kb * 1024


def test_slots_are_prefaulted_in_owner_and_attacher():
    size = HEADER_BYTES + (8 << 20)
    with SlotPool.create(1, 8 << 20) as pool:
        assert mapped_rss_bytes(pool.names[0]) >= size
        child = Child("""
    m = recv()
    rss = {}
    for populate in (True, False):
        attached = SlotPool.attach(m["names"], populate=populate)
        rss[str(populate)] = mapped_rss_bytes(m["names"][0])
        attached.close()
    send(**rss)
    """, prelude="from pathlib import Path\nfrom homepd.kv.segment import SHM_DIR\n" + inspect.getsource(mapped_rss_bytes))
        child.send(names=list(pool.names))
        rss = child.recv()
        child.wait()
    assert rss["True"] >= size
    assert rss["False"] < size // 2  # without MAP_POPULATE the pages would fault on first touch


def test_attach_refuses_foreign_names():
    with pytest.raises(SlotError, match="not the segment names"):
        SlotPool.attach(["something-else"])
    with pytest.raises(SlotError, match="does not exist"):
        SlotPool.attach(["homepd-kv-1-deadbeef-0"])
