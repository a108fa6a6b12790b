"""The KV arena: real shared memory, real processes where ownership matters, no sleeps."""
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

from homepd.errors import ExtentError
from homepd.kv.header import HEADER_BYTES, ExtentState, payload_checksum
from homepd.kv.pool import DATA_OFFSET, ExtentExpectation, ExtentHeader, KVArena, extent_bytes_for
from homepd.kv.ring import RingAllocator
from homepd.kv.segment import SHM_DIR, attach_segment, cleanup_stale_segments, parse_segment_name, unlink_pool_of

FP_A = hashlib.sha256(b"model a").hexdigest()
FP_B = hashlib.sha256(b"model b").hexdigest()
N_CTX = 4096
CAPACITY = 4 << 20


class Arena:
    """A KV arena with the allocator a prefill worker would hold over it."""

    def __init__(self, capacity_bytes: int = CAPACITY, verify: str = "full"):
        self.arena = KVArena.create(capacity_bytes, verify=verify)
        self.ring = RingAllocator(self.arena.capacity_bytes)

    def take(self, n_bytes: int) -> int:
        extent = extent_bytes_for(n_bytes)
        offset = self.ring.alloc(extent)
        assert offset is not None
        self.arena.begin(offset, extent)
        return offset

    def publish(self, data: bytes, request_id: str = "req-1", fingerprint: str = FP_A, n_ctx: int = N_CTX) -> int:
        offset = self.take(len(data))
        self.arena.payload(offset, len(data), request_id)[:] = data
        self.arena.publish(offset, ExtentHeader(request_id, fingerprint, n_ctx, n_tokens=17, payload_bytes=len(data)))
        return offset

    def extent(self, offset: int) -> int:
        return self.ring.length_of(offset)


@pytest.fixture
def arena():
    a = Arena()
    yield a
    a.arena.close()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def expect(request_id: str = "req-1", fingerprint: str = FP_A, n_ctx: int = N_CTX) -> ExtentExpectation:
    return ExtentExpectation(request_id, fingerprint, n_ctx)


def in_shm(arena: KVArena) -> list[str]:
    prefix = f"homepd-kv-{arena.owner_pid}-{arena.token}-"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def flip(arena: KVArena, offset: int, byte: int, mask: int = 0x01) -> None:
    """Flip bits of the extent at ``offset`` through a second mapping (as a stray writer would)."""
    raw = attach_segment(arena.names[0])
    raw[DATA_OFFSET + offset + byte] ^= mask
    raw.close()


PRELUDE = """
import json, os, sys, hashlib
from homepd.kv.pool import ExtentExpectation, ExtentHeader, KVArena, extent_bytes_for
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


def test_round_trip_through_another_process(arena):
    data = random_bytes(300_001, seed=1)
    offset = arena.publish(data, request_id="req-λ")  # non-ascii id, odd length
    child = Child("""
    m = recv()
    arena = KVArena.attach(m["names"], verify="full")
    header, view = arena.open_ready(m["offset"], ExtentExpectation("req-λ", m["fp"], m["n_ctx"]), m["extent"])
    send(sha=hashlib.sha256(view).hexdigest(), n_tokens=header.n_tokens, state=arena.state(m["offset"]).name)
    reply = hashlib.sha256(view).digest() * 1000
    arena.release(m["offset"])  # releases view too
    out = m["reply_at"]
    arena.begin(out, extent_bytes_for(len(reply)))
    arena.payload(out, len(reply))[:] = reply
    arena.publish(out, ExtentHeader("reply", m["fp"], m["n_ctx"], 1, len(reply)))
    send(pid=os.getpid())
    arena.close()
    """)
    reply_at = arena.ring.alloc(extent_bytes_for(32_000))  # the allocator is this process's: it says where
    child.send(names=list(arena.arena.names), offset=offset, extent=arena.extent(offset), fp=FP_A, n_ctx=N_CTX,
               reply_at=reply_at)
    seen = child.recv()
    assert seen == {"sha": hashlib.sha256(data).hexdigest(), "n_tokens": 17, "state": "READING"}
    answer = child.recv()
    assert child.wait() == 0
    assert arena.arena.state(offset) == ExtentState.FREE
    assert arena.arena.holder_pid(reply_at) == answer["pid"]
    header, view = arena.arena.open_ready(reply_at, expect("reply"), extent_bytes_for(32_000))
    assert bytes(view) == hashlib.sha256(data).digest() * 1000
    assert arena.arena.holder_pid(reply_at) == os.getpid()
    assert header.verify == "full" and header.published_s > 0 and header.extent_bytes == extent_bytes_for(32_000)


def test_an_extent_takes_exactly_the_payload_rounded_to_pages_plus_one_header_page(arena):
    assert extent_bytes_for(1) == 2 * 4096 and extent_bytes_for(4096) == 2 * 4096
    assert extent_bytes_for(4097) == 3 * 4096
    a = arena.publish(random_bytes(10_000), "a")
    b = arena.publish(random_bytes(5000), "b")
    assert (a, b) == (0, HEADER_BYTES + 12_288)  # b starts where a ends: no fixed-size gaps
    assert arena.ring.used_bytes == extent_bytes_for(10_000) + extent_bytes_for(5000)


def test_payload_views_take_ctypes_like_state_get_and_set(arena):
    data = random_bytes(4096 * 3 + 5, seed=2)
    offset = arena.take(len(data))
    view = arena.arena.payload(offset, len(data))
    dst = (ctypes.c_uint8 * len(data)).from_buffer(view)  # what LlamaContext.state_get does
    ctypes.memmove(dst, data, len(data))
    del dst
    arena.arena.publish(offset, ExtentHeader("req-1", FP_A, N_CTX, 3, len(data)))
    with pytest.raises(ValueError):
        view[0] = 1  # released at publish: no writes after hand-over
    _, payload = arena.arena.open_ready(offset, expect(), arena.extent(offset))
    src = (ctypes.c_uint8 * len(data)).from_buffer(payload)  # what state_set does
    assert bytes(src) == data
    del src


@pytest.mark.parametrize("byte", [0, 1, 4095, 65_536, 300_000, 300_002])
def test_corrupted_payload_byte_is_caught(arena, byte):
    offset = arena.publish(random_bytes(300_003, seed=3))
    flip(arena.arena, offset, HEADER_BYTES + byte)
    with pytest.raises(ExtentError, match="payload checksum mismatch"):
        arena.arena.open_ready(offset, expect(), arena.extent(offset))
    assert arena.arena.state(offset) == ExtentState.READY  # left for the owner to decide


def test_sampled_checksum_catches_edges_and_sampled_lines():
    a = Arena(8 << 20, verify="sampled")
    n = (4 << 20) - 12_345
    for byte in (7, n - 3, 65_536 + 5 * 4096 + 5 * 64 + 3):  # head, tail, page 5's sampled line
        offset = a.publish(random_bytes(n, seed=byte))
        flip(a.arena, offset, HEADER_BYTES + byte, 0x80)
        with pytest.raises(ExtentError, match=r"checksum mismatch .*\(sampled check\)"):
            a.arena.open_ready(offset, expect(), a.extent(offset))
        a.arena.release(offset)
        a.ring.free(offset)
    a.arena.close()


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
    ("n_ctx", 16, r"KV of 17 tokens \(made with n_ctx 4096\), this decode worker runs n_ctx 16"),
    ("request_id", "req-2", r"request id 'req-1', expected 'req-2'"),
])
def test_mismatched_expectation_names_the_field(arena, field, bad, message):
    offset = arena.publish(random_bytes(1000))
    with pytest.raises(ExtentError, match=message):
        arena.arena.open_ready(offset, expect(**{field: bad}), arena.extent(offset))
    assert arena.arena.state(offset) == ExtentState.READY
    arena.arena.open_ready(offset, expect(n_ctx=17), arena.extent(offset))  # a smaller consumer context fits


def test_a_consumer_told_another_extent_length_is_refused(arena):
    offset = arena.publish(random_bytes(1000))
    with pytest.raises(ExtentError, match="the arena gave it 4096"):
        arena.arena.open_ready(offset, expect(), 4096)


def test_corrupted_header_is_caught(arena):
    offset = arena.publish(random_bytes(1000))
    flip(arena.arena, offset, 40)  # inside the body: payload size area
    with pytest.raises(ExtentError, match="header checksum mismatch"):
        arena.arena.open_ready(offset, expect(), arena.extent(offset))


def test_payload_over_the_extent_says_so(arena):
    offset = arena.take(4096)
    with pytest.raises(ExtentError, match=r"'req-9' needs 4097 bytes, its extent at 0 holds 4096"):
        arena.arena.payload(offset, 4097, "req-9")
    with pytest.raises(ExtentError, match="holds 4096"):
        arena.arena.publish(offset, ExtentHeader("req-9", FP_A, N_CTX, 1, 4097))


def test_bad_header_fields_are_refused(arena):
    offset = arena.take(10)
    with pytest.raises(ExtentError, match="at most 64"):
        arena.arena.publish(offset, ExtentHeader("x" * 65, FP_A, N_CTX, 1, 10))
    with pytest.raises(ExtentError, match="not a hex sha256"):
        arena.arena.publish(offset, ExtentHeader("r", "abc", N_CTX, 1, 10))
    assert arena.arena.state(offset) == ExtentState.WRITING


def test_ranges_outside_the_arena_or_unaligned_are_refused(arena):
    for offset in (-4096, 100, CAPACITY):
        with pytest.raises(ExtentError, match="not a page-aligned range"):
            arena.arena.state(offset)
    with pytest.raises(ExtentError, match="not a page-aligned range"):
        arena.arena.begin(CAPACITY - 4096, 2 * 4096)


def test_an_offset_inside_another_extent_is_not_an_extent(arena):
    offset = arena.publish(bytes(50_000))  # zeros: no magic anywhere in the payload
    inside = offset + 3 * 4096
    assert arena.arena.state(inside) is None and arena.arena.request_in(inside) is None
    with pytest.raises(ExtentError, match="no KV extent starts at"):
        arena.arena.reset_stale(inside)


def test_wrong_state_transitions_are_refused(arena):
    offset = arena.publish(random_bytes(100))
    with pytest.raises(ExtentError, match="is READY, expected WRITING"):
        arena.arena.payload(offset, 10)
    arena.arena.open_ready(offset, expect(), arena.extent(offset))
    with pytest.raises(ExtentError, match="is READING, expected READY"):
        arena.arena.open_ready(offset, expect(), arena.extent(offset))
    arena.arena.release(offset)
    with pytest.raises(ExtentError, match="released twice"):
        arena.arena.release(offset)


@pytest.mark.parametrize("how", ["return", "os._exit", "SIGKILL"])
def test_attacher_exit_leaves_the_owners_segment(arena, how):
    data = random_bytes(5000, seed=4)
    offset = arena.publish(data)
    child = Child("""
    m = recv()
    arena = KVArena.attach(m["names"])
    arena.state(0)
    send(attached=True)
    if m["how"] == "os._exit":
        os._exit(0)
    if m["how"] == "SIGKILL":
        recv()  # blocks until killed
    """)
    child.send(names=list(arena.arena.names), how=how)
    assert child.recv() == {"attached": True}
    if how == "SIGKILL":
        child.process.send_signal(signal.SIGKILL)
    child.wait()
    assert in_shm(arena.arena) == sorted(arena.arena.names)
    _, view = arena.arena.open_ready(offset, expect(), arena.extent(offset))
    assert bytes(view) == data


def test_owner_close_unlinks_even_with_a_live_export():
    a = Arena(8192 * 2)
    names = a.arena.names
    assert in_shm(a.arena) == sorted(names)
    offset = a.take(10)
    held = (ctypes.c_uint8 * 10).from_buffer(a.arena.payload(offset, 10))  # a ctypes array still alive
    a.arena.close()
    a.arena.close()  # idempotent
    assert in_shm(a.arena) == []
    held[0] = 1  # the mapping lives until its export dies
    del held
    with pytest.raises(ExtentError, match="closed KV arena"):
        a.arena.state(0)


def test_attacher_close_does_not_unlink(arena):
    with KVArena.attach(list(arena.arena.names)) as attached:
        assert attached.capacity_bytes == CAPACITY
        assert (attached.owner_pid, attached.token, attached.is_owner) == (os.getpid(), arena.arena.token, False)
    assert in_shm(arena.arena) == sorted(arena.arena.names)


def test_owner_exiting_without_close_unlinks_at_exit():
    child = Child("""
    arena = KVArena.create(1 << 20)
    send(names=list(arena.names))
    """)
    names = child.recv()["names"]
    assert child.wait() == 0
    assert not any((SHM_DIR / name).exists() for name in names)


def leak_an_arena() -> list[str]:
    """A child creates an arena and dies without cleaning up (os._exit): its pid is dead after wait()."""
    child = Child("""
    arena = KVArena.create(1 << 20)
    send(names=list(arena.names))
    os._exit(0)
    """)
    names = child.recv()["names"]
    child.wait()
    assert all((SHM_DIR / name).exists() for name in names)
    return names


def test_cleanup_stale_segments_removes_dead_owners_only(arena):
    dead_names = leak_an_arena()
    removed = cleanup_stale_segments()
    assert set(dead_names) <= set(removed)
    assert not any((SHM_DIR / name).exists() for name in dead_names)
    assert in_shm(arena.arena) == sorted(arena.arena.names)  # live arena untouched
    assert all(parse_segment_name(name)[0] != os.getpid() for name in removed)


def test_worker_unlinks_the_arena_of_a_dead_controller():
    names = leak_an_arena()
    worker = KVArena.attach(names)
    assert sorted(unlink_pool_of(worker.owner_pid, worker.token)) == sorted(names)
    assert worker.state(0) is None  # still mapped after unlink (and empty)
    worker.close()


def test_dead_consumer_extent_goes_back_to_ready(arena):
    data = random_bytes(20_000, seed=5)
    offset = arena.publish(data)
    child = Child("""
    m = recv()
    arena = KVArena.attach(m["names"])
    arena.open_ready(m["offset"], ExtentExpectation("req-1", m["fp"], m["n_ctx"]), m["extent"])
    send(pid=os.getpid())
    recv()  # blocks until killed
    """)
    child.send(names=list(arena.arena.names), offset=offset, extent=arena.extent(offset), fp=FP_A, n_ctx=N_CTX)
    pid = child.recv()["pid"]
    child.process.send_signal(signal.SIGKILL)
    child.wait()
    assert arena.arena.state(offset) == ExtentState.READING and arena.arena.holder_pid(offset) == pid
    with pytest.raises(ExtentError, match="only READING goes back to READY"):
        arena.arena.reset_stale(arena.take(10), ExtentState.READY)
    arena.arena.reset_stale(offset, ExtentState.READY)
    _, view = arena.arena.open_ready(offset, expect(), arena.extent(offset))
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


def test_the_arena_is_prefaulted_in_owner_and_attacher():
    size = DATA_OFFSET + (8 << 20)
    with KVArena.create(8 << 20) as arena:
        assert mapped_rss_bytes(arena.names[0]) >= size
        child = Child("""
    m = recv()
    rss = {}
    for populate in (True, False):
        attached = KVArena.attach(m["names"], populate=populate)
        rss[str(populate)] = mapped_rss_bytes(m["names"][0])
        attached.close()
    send(**rss)
    """, prelude="from pathlib import Path\nfrom homepd.kv.segment import SHM_DIR\n" + inspect.getsource(mapped_rss_bytes))
        child.send(names=list(arena.names))
        rss = child.recv()
        child.wait()
    assert rss["True"] >= size
    assert rss["False"] < size // 2  # without MAP_POPULATE the pages would fault on first touch


def test_attach_refuses_foreign_names_and_segments():
    with pytest.raises(ExtentError, match="not the segment names"):
        KVArena.attach(["something-else"])
    with pytest.raises(ExtentError, match="does not exist"):
        KVArena.attach(["homepd-kv-1-deadbeef-0"])
    with KVArena.create(1 << 20) as arena:
        raw = attach_segment(arena.names[0])
        raw[0] ^= 0xFF  # not an arena header any more
        raw.close()
        with pytest.raises(ExtentError, match="run the controller and workers from the same homepd install"):
            KVArena.attach(arena.names)
