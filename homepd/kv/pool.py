"""The KV arena: one pre-faulted shared-memory segment that carries requests' KV state
from a prefill worker to a decode worker, each in an extent of exactly the bytes it needs.

Page 0 of the segment is the arena header (magic, version, data bytes); the
data region after it is carved into extents by the prefill worker's
``RingAllocator`` (``homepd.kv.ring``).  An extent is a one-page header
(``homepd.kv.header``) followed by the payload, rounded up to whole pages;
offsets below are from the start of the data region.

The controller creates the arena (and unlinks it at close); workers attach by
name and only close.  The prefill worker allocates an extent and ``begin``\\ s
it (→ WRITING), lets ``state_get`` write into ``payload()``, ``publish``\\ es it
(→ READY) and sends ``KVHandoff(offset)``; the decode worker ``open_ready``\\ s
it (→ READING), ``state_set``\\ s from the view and ``release``\\ s it (→ FREE);
the prefill worker sees the FREE state byte and gives the bytes back to its
allocator.  The controller resets what a dead worker held (``reset_stale``).

# why a plain byte store is enough for the state: every transition of an
# extent has exactly one writer, so there is no compare-and-swap to lose; and a
# consumer only looks at an extent after a pipe message told it to, and the
# syscalls on both ends order the payload and header writes before the read
# (x86 would order them anyway; ARM needs the syscall's barrier).  The state
# byte is a check that catches protocol bugs, not the synchronisation.
"""
from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from dataclasses import replace

from homepd.errors import ExtentError
from homepd.kv.header import (BODY_OFFSET, HEADER_BYTES, HEADER_CRC_OFFSET, HOLDER_PID_OFFSET, LAYOUT_VERSION,
                              MAGIC, PREFIX, STATE_OFFSET, VERIFY_KINDS, ExtentExpectation, ExtentHeader, ExtentState,
                              check_header, header_checksum, pack_body, payload_checksum, unpack_body)
from homepd.kv.ring import PAGE_BYTES
from homepd.kv.segment import (NAME_PREFIX, allocate_range, attach_segment, create_segment, new_token,
                               parse_segment_name, segment_name, unlink_segment)

__all__ = ["KVArena", "ExtentHeader", "ExtentExpectation", "ExtentState", "payload_checksum", "extent_bytes_for"]

ARENA_MAGIC = b"HPDKVAR\0"
ARENA_HEADER = struct.Struct("<8sH6xQ")  # magic, LAYOUT_VERSION, data bytes
DATA_OFFSET = PAGE_BYTES                 # the data region starts after the arena header page


def extent_bytes_for(payload_bytes: int) -> int:
    """What a payload of ``payload_bytes`` takes in the arena: the header page plus whole payload pages."""
    return HEADER_BYTES + -(-payload_bytes // PAGE_BYTES) * PAGE_BYTES


class KVArena:
    """One segment: the arena header page, then ``capacity_bytes`` of extents; see the module docstring."""

    def __init__(self, names: list[str], shm_map, *, is_owner: bool, verify: str):
        self.names = tuple(names)
        self.owner_pid, self.token = _arena_identity(names)
        self.is_owner = is_owner
        self.verify = verify
        self._map = shm_map
        self._buf = memoryview(shm_map)
        self.capacity_bytes = len(shm_map) - DATA_OFFSET
        self._writing: dict[int, int] = {}              # extents this process began: offset -> extent bytes
        self._views: dict[int, list[memoryview]] = {}   # handed out, released on hand-over
        self._lock = threading.Lock()
        self._closed = False
        # why: an owner that forgets close() still unlinks at interpreter exit;
        # the pid check keeps a forked child from unlinking its parent's arena.
        self._finalizer = weakref.finalize(self, _unlink_if_pid, list(names), os.getpid()) if is_owner else None

    # lifecycle ---------------------------------------------------------------
    @classmethod
    def create(cls, capacity_bytes: int, owner_pid: int | None = None, verify: str = "sampled",
               prefix: str = NAME_PREFIX, prefault: bool = True) -> KVArena:
        """Create, allocate and pre-fault an arena of ``capacity_bytes`` (rounded up to pages) for extents.

        ``verify`` is the payload checksum this process writes when it publishes
        ("sampled" or "full", see ``payload_checksum``); consumers check whatever
        the header says.  Raises ExtentError if /dev/shm has no room.
        """
        _check_verify(verify)
        if capacity_bytes < extent_bytes_for(1):
            raise ExtentError(f"a KV arena needs at least {extent_bytes_for(1)} bytes (one page of header and one "
                              f"of payload), got {capacity_bytes}")
        capacity_bytes = -(-capacity_bytes // PAGE_BYTES) * PAGE_BYTES
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        name = segment_name(owner_pid, new_token(), 0, prefix)
        shm_map = create_segment(name, DATA_OFFSET + capacity_bytes, prefault)
        try:
            ARENA_HEADER.pack_into(shm_map, 0, ARENA_MAGIC, LAYOUT_VERSION, capacity_bytes)
        except BaseException:
            unlink_segment(name)
            shm_map.close()
            raise
        return cls([name], shm_map, is_owner=True, verify=verify)

    @classmethod
    def attach(cls, names: list[str] | tuple[str, ...], verify: str = "sampled", populate: bool = True) -> KVArena:
        """Map the arena another process created; ``close()`` will not unlink it.

        ``populate`` maps every page now so the first export/import does not take page faults.
        """
        _check_verify(verify)
        _arena_identity(names)
        shm_map = attach_segment(names[0], populate)
        magic, version, data_bytes = ARENA_HEADER.unpack_from(shm_map)
        if (magic, version) != (ARENA_MAGIC, LAYOUT_VERSION) or data_bytes != len(shm_map) - DATA_OFFSET:
            shm_map.close()
            raise ExtentError(f"{names[0]} has magic {magic!r} version {version} ({data_bytes} data bytes), this "
                              f"homepd reads {ARENA_MAGIC!r} version {LAYOUT_VERSION} — run the controller and "
                              "workers from the same homepd install")
        return cls(list(names), shm_map, is_owner=False, verify=verify)

    def close(self) -> None:
        """Unmap; the owner also unlinks.  Idempotent, never raises.

        A payload view still exported (a live ctypes array over it) keeps its
        mapping until that export dies; the name is gone either way.
        """
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()  # unlink first: nothing in /dev/shm even if an unmap fails
        for offset in list(self._views):
            self._release_views(offset)
        try:
            self._buf.release()
            self._map.close()
        except BufferError:
            pass

    def __enter__(self) -> KVArena:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # producer (the process that owns the allocator) -------------------------------
    def begin(self, offset: int, extent_bytes: int) -> None:
        """Start writing an extent the allocator just gave out (→ WRITING, held by this process)."""
        self._check_range(offset, extent_bytes, "begin")
        if extent_bytes < extent_bytes_for(1) or extent_bytes % PAGE_BYTES:
            raise ExtentError(f"begin: an extent of {extent_bytes} bytes is not a header page plus whole payload pages")
        at = DATA_OFFSET + offset
        PREFIX.pack_into(self._buf, at, MAGIC, LAYOUT_VERSION, ExtentState.WRITING, os.getpid(), 0)
        self._writing[offset] = extent_bytes

    def allocate(self, offset: int, extent_bytes: int) -> None:
        """Allocate an extent's pages now, before ``begin`` writes its header: for an arena created without
        ``prefault``, where a write into a page /dev/shm has no room for would be a SIGBUS.  ExtentError if
        there is no room."""
        self._check_range(offset, extent_bytes, "allocate")
        allocate_range(self.names[0], DATA_OFFSET + offset, extent_bytes)

    def payload(self, offset: int, n_bytes: int, request_id: str = "") -> memoryview:
        """A writable view of the first ``n_bytes`` of a WRITING extent's payload, for ``state_get``."""
        self._expect_state(offset, ExtentState.WRITING, "payload")
        capacity = self._writing.get(offset, HEADER_BYTES) - HEADER_BYTES
        if n_bytes > capacity:
            raise ExtentError(f"KV state of request {request_id!r} needs {n_bytes} bytes, its extent at {offset} "
                              f"holds {capacity} — allocate extent_bytes_for({n_bytes})")
        return self._hand_out(offset, n_bytes)

    def publish(self, offset: int, header: ExtentHeader) -> ExtentHeader:
        """Checksum the payload, write the header, mark the extent READY; returns the header as stored.

        Views from ``payload()`` are released: writing after publish is an error.
        """
        self._expect_state(offset, ExtentState.WRITING, "publish")
        extent = self._writing.get(offset)
        if extent is None:
            raise ExtentError(f"publish: the extent at {offset} was not begun by this process")
        if header.payload_bytes > extent - HEADER_BYTES:
            raise ExtentError(f"KV state of request {header.request_id!r} is {header.payload_bytes} bytes, its "
                              f"extent at {offset} holds {extent - HEADER_BYTES}")
        if header.n_tokens > header.n_ctx:
            raise ExtentError(f"request {header.request_id!r}: n_tokens {header.n_tokens} > n_ctx {header.n_ctx}")
        self._release_views(offset)
        at = DATA_OFFSET + offset
        buf = self._buf[at:at + extent]
        checksum = payload_checksum(buf[HEADER_BYTES:], header.payload_bytes, self.verify)
        stored = replace(header, payload_checksum=checksum, verify=self.verify, published_s=time.monotonic(),
                         extent_bytes=extent)
        body = pack_body(stored)
        buf[BODY_OFFSET:BODY_OFFSET + len(body)] = body
        buf[BODY_OFFSET + len(body):HEADER_BYTES] = bytes(HEADER_BYTES - BODY_OFFSET - len(body))
        buf[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4] = header_checksum(buf).to_bytes(4, "little")
        del self._writing[offset]
        self._set_state(offset, ExtentState.READY)
        return stored

    # consumer ------------------------------------------------------------------
    def open_ready(self, offset: int, expect: ExtentExpectation, extent_bytes: int) -> tuple[ExtentHeader, memoryview]:
        """Verify a READY extent against ``expect`` (→ READING); its header and a writable payload view.

        ``extent_bytes``: its length as the handoff message says.  Every mismatch
        raises ExtentError naming the field, leaving the extent READY.
        """
        self._check_range(offset, extent_bytes, "open_ready")
        self._expect_state(offset, ExtentState.READY, "open_ready")
        at = DATA_OFFSET + offset
        header = check_header(f"KV extent at {offset}", self._buf[at:at + HEADER_BYTES], expect, extent_bytes)
        self._set_state(offset, ExtentState.READING)
        self._set_holder(offset)
        found = payload_checksum(self._buf[at + HEADER_BYTES:at + extent_bytes], header.payload_bytes, header.verify)
        if found != header.payload_checksum:
            self._set_state(offset, ExtentState.READY)
            raise ExtentError(f"KV extent at {offset} payload checksum mismatch for request {header.request_id!r} "
                              f"({header.verify} check): header says {header.payload_checksum:016x}, payload "
                              f"gives {found:016x} — the KV was overwritten after publish")
        return header, self._hand_out(offset, header.payload_bytes)

    def peek_ready(self, offset: int, expect: ExtentExpectation, extent_bytes: int) -> tuple[ExtentHeader, memoryview]:
        """``open_ready`` without taking the extent: it stays READY for the next reader (the KV store reads
        an entry many times); a view of the payload, released by ``release_views``."""
        self._check_range(offset, extent_bytes, "peek_ready")
        self._expect_state(offset, ExtentState.READY, "peek_ready")
        at = DATA_OFFSET + offset
        header = check_header(f"KV extent at {offset}", self._buf[at:at + HEADER_BYTES], expect, extent_bytes)
        found = payload_checksum(self._buf[at + HEADER_BYTES:at + extent_bytes], header.payload_bytes, header.verify)
        if found != header.payload_checksum:
            raise ExtentError(f"KV extent at {offset} payload checksum mismatch for {header.request_id!r}")
        return header, self._hand_out(offset, header.payload_bytes)

    def release_views(self, offset: int) -> None:
        self._release_views(offset)

    def release(self, offset: int) -> None:
        """Back to FREE: a consumer done importing, a producer abandoning an export, or a cancel."""
        state = self.state(offset)
        if state is None:
            raise ExtentError(f"release: no KV extent starts at {offset}")
        if state == ExtentState.FREE:
            raise ExtentError(f"KV extent at {offset} released twice — it is already FREE")
        self._release_views(offset)
        self._writing.pop(offset, None)
        self._set_state(offset, ExtentState.FREE)

    # anyone's view, and recovery ----------------------------------------------------
    def state(self, offset: int) -> ExtentState | None:
        """The state of the extent at ``offset``; None if no extent header starts there (never was, or
        overwritten by a later extent after this one was freed)."""
        self._check_range(offset, HEADER_BYTES, "state")
        at = DATA_OFFSET + offset
        if self._buf[at:at + len(MAGIC)] != MAGIC:
            return None
        code = self._buf[at + STATE_OFFSET]
        return ExtentState(code) if code in ExtentState._value2member_map_ else None

    def holder_pid(self, offset: int) -> int:
        """The process that last took the extent: ``begin`` or ``open_ready`` (0: none yet)."""
        at = DATA_OFFSET + offset + HOLDER_PID_OFFSET
        return int.from_bytes(self._buf[at:at + 4], "little")

    def header_at(self, offset: int) -> ExtentHeader | None:
        """The (intact) header of a READY or READING extent at ``offset``; None otherwise."""
        if self.state(offset) not in (ExtentState.READY, ExtentState.READING):
            return None
        at = DATA_OFFSET + offset
        header_buf = self._buf[at:at + HEADER_BYTES]
        if header_checksum(header_buf) != int.from_bytes(header_buf[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4],
                                                         "little"):
            return None
        return unpack_body(header_buf[BODY_OFFSET:])

    def request_in(self, offset: int) -> str | None:
        """The request id a READY or READING extent's (intact) header names; None otherwise."""
        header = self.header_at(offset)
        return header.request_id if header is not None else None

    def reset_stale(self, offset: int, to: ExtentState = ExtentState.FREE) -> None:
        """Recover the extent of a dead worker: to FREE from any state, or READING → READY
        (the payload is intact; another decode worker may import it, checksums still apply)."""
        to = ExtentState(to)
        found = self.state(offset)
        if found is None:
            raise ExtentError(f"reset_stale: no KV extent starts at {offset}")
        if not (to == ExtentState.FREE or (to == ExtentState.READY and found == ExtentState.READING)):
            raise ExtentError(f"KV extent at {offset} cannot go from {found.name} to {to.name}: only READING "
                              "goes back to READY (a WRITING extent's payload is incomplete), anything goes to FREE")
        self._release_views(offset)
        self._set_state(offset, to)

    # internals -------------------------------------------------------------------
    def _set_state(self, offset: int, state: ExtentState) -> None:
        self._buf[DATA_OFFSET + offset + STATE_OFFSET] = state

    def _set_holder(self, offset: int) -> None:
        at = DATA_OFFSET + offset + HOLDER_PID_OFFSET
        self._buf[at:at + 4] = os.getpid().to_bytes(4, "little")

    def _check_range(self, offset: int, n_bytes: int, action: str) -> None:
        if self._closed:
            raise ExtentError(f"{action} at {offset} on a closed KV arena")
        if offset < 0 or offset % PAGE_BYTES or offset + n_bytes > self.capacity_bytes:
            raise ExtentError(f"{action}: [{offset}, {offset + n_bytes}) is not a page-aligned range of the "
                              f"{self.capacity_bytes}-byte KV arena")

    def _expect_state(self, offset: int, expected: ExtentState, action: str) -> None:
        self._check_range(offset, HEADER_BYTES, action)
        found = self.state(offset)
        if found != expected:
            raise ExtentError(f"{action}: KV extent at {offset} is "
                              f"{found.name if found is not None else 'not an extent'}, expected {expected.name} "
                              "— it was not handed to this process in that state")

    def _hand_out(self, offset: int, n_bytes: int) -> memoryview:
        at = DATA_OFFSET + offset + HEADER_BYTES
        view = self._buf[at:at + n_bytes]
        self._views.setdefault(offset, []).append(view)
        return view

    def _release_views(self, offset: int) -> None:
        for view in self._views.pop(offset, ()):
            try:
                view.release()
            except BufferError:
                pass  # still exported (a live ctypes array); dies with its export


def _unlink_if_pid(names: list[str], creator_pid: int) -> None:
    if os.getpid() == creator_pid:
        for name in names:
            unlink_segment(name)


def _arena_identity(names) -> tuple[int, str]:
    parsed = [parse_segment_name(name) for name in names]
    if len(parsed) != 1 or None in parsed:
        raise ExtentError(f"{list(names)!r} are not the segment names of a homepd KV arena "
                          "— pass KVArena.names of the controller's arena")
    return parsed[0][0], parsed[0][1]


def _check_verify(verify: str) -> None:
    if verify not in VERIFY_KINDS:
        raise ExtentError(f"verify must be one of {sorted(VERIFY_KINDS)}, not {verify!r}")
