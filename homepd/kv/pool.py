"""A pool of pre-faulted shared-memory slots that carry one request's KV state
from a prefill worker to a decode worker.

The controller creates the pool (and unlinks it at close); workers attach by
name and only close.  A slot goes FREE → WRITING (``acquire_free``, by the one
allocator, normally the controller, which names the slot in the prefill
message) → READY (``publish``, by the prefill worker, after ``state_get`` wrote
into ``payload()``) → READING (``open_ready``, by the decode worker, which then
``state_set``s from the returned view) → FREE (``release``).

# why a plain byte store is enough for the state: every transition of a slot
# has exactly one writer, so there is no compare-and-swap to lose; and a
# consumer only looks at a slot after a pipe message told it to, and the
# syscalls on both ends order the payload and header writes before the read
# (x86 would order them anyway; ARM needs the syscall's barrier).  The state
# byte is a check that catches protocol bugs, not the synchronisation.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import replace

from homepd.errors import SlotError
from homepd.kv.header import (BODY_OFFSET, HEADER_BYTES, HEADER_CRC_OFFSET, HOLDER_PID_OFFSET,
                                  LAYOUT_VERSION, MAGIC, PREFIX, STATE_OFFSET, VERIFY_KINDS,
                                  SlotExpectation, SlotHeader, SlotState, check_header,
                                  header_checksum, pack_body, payload_checksum, unpack_body)
from homepd.kv.segment import (attach_segment, create_segment, new_token, parse_segment_name,
                                   segment_name, unlink_segment)

__all__ = ["SlotPool", "SlotHeader", "SlotExpectation", "SlotState", "payload_checksum"]


class SlotPool:
    """``n_slots`` segments of ``HEADER_BYTES + capacity_bytes`` each; see the module docstring."""

    def __init__(self, names: list[str], maps, *, is_owner: bool, verify: str):
        self.names = tuple(names)
        self.owner_pid, self.token = _pool_identity(names)
        self.is_owner = is_owner
        self.verify = verify
        self._maps = list(maps)
        self._bufs = [memoryview(m) for m in self._maps]
        self._views: list[list[memoryview]] = [[] for _ in names]  # handed out, released on hand-over
        self.capacity_bytes = len(self._maps[0]) - HEADER_BYTES
        self._lock = threading.Lock()
        self._closed = False
        # why: an owner that forgets close() still unlinks at interpreter exit;
        # the pid check keeps a forked child from unlinking its parent's pool.
        self._finalizer = weakref.finalize(self, _unlink_if_pid, list(names), os.getpid()) if is_owner else None

    # lifecycle ---------------------------------------------------------------
    @classmethod
    def create(cls, n_slots: int, capacity_bytes: int, owner_pid: int | None = None,
               verify: str = "sampled") -> SlotPool:
        """Create, allocate and pre-fault ``n_slots`` slots of ``capacity_bytes`` payload each.

        ``verify`` is the payload checksum this process writes when it publishes
        ("sampled" or "full", see ``payload_checksum``); consumers check whatever
        the header says.  Raises SlotError if /dev/shm has no room.
        """
        _check_verify(verify)
        if n_slots < 1 or capacity_bytes < 1:
            raise SlotError(f"a KV slot pool needs n_slots ≥ 1 and capacity_bytes ≥ 1, got {n_slots}, {capacity_bytes}")
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        token = new_token()
        names, maps = [], []
        try:
            for index in range(n_slots):
                name = segment_name(owner_pid, token, index)
                maps.append(create_segment(name, HEADER_BYTES + capacity_bytes))
                names.append(name)
                PREFIX.pack_into(maps[-1], 0, MAGIC, LAYOUT_VERSION, SlotState.FREE, 0, 0)
        except BaseException:
            for name in names:
                unlink_segment(name)
            for m in maps:
                m.close()
            raise
        return cls(names, maps, is_owner=True, verify=verify)

    @classmethod
    def attach(cls, names: list[str], verify: str = "sampled", populate: bool = True) -> SlotPool:
        """Map the slots of a pool another process created; ``close()`` will not unlink them.

        ``populate`` maps every page now so the first export/import does not take page faults.
        """
        _check_verify(verify)
        _pool_identity(names)
        maps = []
        try:
            for name in names:
                maps.append(attach_segment(name, populate))
            sizes = {len(m) for m in maps}
            if len(sizes) != 1:
                raise SlotError(f"the segments of {names[0]}… differ in size {sorted(sizes)} — not one pool")
            for index, m in enumerate(maps):
                magic, version = PREFIX.unpack_from(m)[:2]
                if (magic, version) != (MAGIC, LAYOUT_VERSION):
                    raise SlotError(f"{names[index]} has magic {magic!r} version {version}, this homepd "
                                    f"reads {MAGIC!r} version {LAYOUT_VERSION} — run the controller and "
                                    "workers from the same homepd install")
        except BaseException:
            for m in maps:
                m.close()
            raise
        return cls(list(names), maps, is_owner=False, verify=verify)

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
        for slot in range(len(self.names)):
            self._release_views(slot)
            try:
                self._bufs[slot].release()
                self._maps[slot].close()
            except BufferError:
                pass

    def __enter__(self) -> SlotPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.names)

    # producer ------------------------------------------------------------------
    def acquire_free(self) -> int | None:
        """Take a FREE slot (→ WRITING) and return its index; None when all are busy.

        None is back-pressure, not an error: wait for a release and retry.  Call
        from one process only (the allocator); thread-safe within it.
        """
        if self._closed:
            raise SlotError("acquire_free on a closed pool")
        with self._lock:
            for slot in range(len(self.names)):
                if self._bufs[slot][STATE_OFFSET] == SlotState.FREE:
                    self._set_state(slot, SlotState.WRITING)
                    self._set_holder(slot)
                    return slot
        return None

    def payload(self, slot: int, n_bytes: int, request_id: str = "") -> memoryview:
        """A writable view of the first ``n_bytes`` of a WRITING slot's payload, for ``state_get``."""
        self._expect_state(slot, SlotState.WRITING, "payload")
        if n_bytes > self.capacity_bytes:
            raise SlotError(f"KV state of request {request_id!r} needs {n_bytes} bytes, a KV slot holds "
                            f"{self.capacity_bytes} — create the slot pool with capacity for the full "
                            "n_ctx (state bytes per token × n_ctx + overhead)")
        self._set_holder(slot)
        return self._hand_out(slot, n_bytes)

    def publish(self, slot: int, header: SlotHeader) -> SlotHeader:
        """Checksum the payload, write the header, mark the slot READY; returns the header as stored.

        Views from ``payload()`` are released: writing after publish is an error.
        """
        self._expect_state(slot, SlotState.WRITING, "publish")
        if header.payload_bytes > self.capacity_bytes:
            raise SlotError(f"KV state of request {header.request_id!r} is {header.payload_bytes} bytes, "
                            f"a KV slot holds {self.capacity_bytes} — create the slot pool with capacity "
                            "for the full n_ctx")
        if header.n_tokens > header.n_ctx:
            raise SlotError(f"request {header.request_id!r}: n_tokens {header.n_tokens} > n_ctx {header.n_ctx}")
        self._release_views(slot)
        buf = self._bufs[slot]
        checksum = payload_checksum(buf[HEADER_BYTES:], header.payload_bytes, self.verify)
        stored = replace(header, payload_checksum=checksum, verify=self.verify, published_s=time.monotonic())
        body = pack_body(stored)
        buf[BODY_OFFSET:BODY_OFFSET + len(body)] = body
        buf[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4] = header_checksum(buf).to_bytes(4, "little")
        self._set_state(slot, SlotState.READY)
        return stored

    # consumer ------------------------------------------------------------------
    def open_ready(self, slot: int, expect: SlotExpectation) -> tuple[SlotHeader, memoryview]:
        """Verify a READY slot against ``expect`` (→ READING); its header and a writable payload view.

        Every mismatch raises SlotError naming the field, leaving the slot READY.
        """
        self._expect_state(slot, SlotState.READY, "open_ready")
        buf = self._bufs[slot]
        header = check_header(slot, buf[:HEADER_BYTES], expect, self.capacity_bytes)
        self._set_state(slot, SlotState.READING)
        self._set_holder(slot)
        found = payload_checksum(buf[HEADER_BYTES:], header.payload_bytes, header.verify)
        if found != header.payload_checksum:
            self._set_state(slot, SlotState.READY)
            raise SlotError(f"slot {slot} payload checksum mismatch for request {header.request_id!r} "
                            f"({header.verify} check): header says {header.payload_checksum:016x}, payload "
                            f"gives {found:016x} — the KV was overwritten after publish")
        return header, self._hand_out(slot, header.payload_bytes)

    def release(self, slot: int) -> None:
        """Back to FREE: a consumer done importing, a producer abandoning an export, or a cancel."""
        if self._state_checked(slot, "release") == SlotState.FREE:
            raise SlotError(f"slot {slot} released twice — it is already FREE")
        self._release_views(slot)
        self._set_state(slot, SlotState.FREE)

    # owner's view and recovery -------------------------------------------------
    def state(self, slot: int) -> SlotState:
        return self._state_checked(slot, "state")

    def states(self) -> list[str]:
        return [self.state(slot).name for slot in range(len(self.names))]

    def occupancy(self) -> dict[str, int]:
        """Slots per state, every state present: ``{"FREE": 3, "WRITING": 1, "READY": 0, "READING": 0}``."""
        counts = dict.fromkeys((state.name for state in SlotState), 0)
        for name in self.states():
            counts[name] += 1
        return counts

    def holder_pid(self, slot: int) -> int:
        """The process that last took the slot: ``acquire_free``, ``payload`` or ``open_ready`` (0: none yet)."""
        return int.from_bytes(self._bufs[slot][HOLDER_PID_OFFSET:HOLDER_PID_OFFSET + 4], "little")

    def request_in(self, slot: int) -> str | None:
        """The request id a READY or READING slot's (intact) header names; None otherwise."""
        if self.state(slot) not in (SlotState.READY, SlotState.READING):
            return None
        buf = self._bufs[slot]
        if header_checksum(buf) != int.from_bytes(buf[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 4], "little"):
            return None
        return unpack_body(buf[BODY_OFFSET:HEADER_BYTES]).request_id

    def slots_held_by(self, pid: int) -> list[int]:
        """WRITING / READING slots whose holder is ``pid``: what a dead worker left behind."""
        return [slot for slot in range(len(self.names))
                if self.state(slot) in (SlotState.WRITING, SlotState.READING) and self.holder_pid(slot) == pid]

    def reset_stale(self, slot: int, to: SlotState = SlotState.FREE) -> None:
        """Recover the slot of a dead worker: to FREE from any state, or READING → READY
        (the payload is intact; another decode worker may import it, checksums still apply)."""
        to = SlotState(to)
        found = self._state_checked(slot, "reset_stale")
        if not (to == SlotState.FREE or (to == SlotState.READY and found == SlotState.READING)):
            raise SlotError(f"slot {slot} cannot go from {found.name} to {to.name}: only READING "
                            "goes back to READY (a WRITING slot's payload is incomplete), anything goes to FREE")
        self._release_views(slot)
        self._set_state(slot, to)

    # internals -------------------------------------------------------------------
    def _set_state(self, slot: int, state: SlotState) -> None:
        self._bufs[slot][STATE_OFFSET] = state

    def _set_holder(self, slot: int) -> None:
        self._bufs[slot][HOLDER_PID_OFFSET:HOLDER_PID_OFFSET + 4] = os.getpid().to_bytes(4, "little")

    def _expect_state(self, slot: int, expected: SlotState, action: str) -> None:
        found = self._state_checked(slot, action)
        if found != expected:
            raise SlotError(f"{action}: slot {slot} is {found.name}, expected {expected.name} "
                            "— the slot was not handed to this process in that state")

    def _state_checked(self, slot: int, action: str) -> SlotState:
        if self._closed:
            raise SlotError(f"{action} on slot {slot} of a closed pool")
        if not 0 <= slot < len(self.names):
            raise SlotError(f"{action}: slot {slot} out of range, the pool has {len(self.names)} slots")
        return SlotState(self._bufs[slot][STATE_OFFSET])

    def _hand_out(self, slot: int, n_bytes: int) -> memoryview:
        view = self._bufs[slot][HEADER_BYTES:HEADER_BYTES + n_bytes]
        self._views[slot].append(view)
        return view

    def _release_views(self, slot: int) -> None:
        for view in self._views[slot]:
            try:
                view.release()
            except BufferError:
                pass  # still exported (a live ctypes array); dies with its export
        self._views[slot].clear()


def _unlink_if_pid(names: list[str], creator_pid: int) -> None:
    if os.getpid() == creator_pid:
        for name in names:
            unlink_segment(name)


def _pool_identity(names) -> tuple[int, str]:
    parsed = [parse_segment_name(name) for name in names]
    if not parsed or None in parsed or len({(pid, token) for pid, token, _ in parsed}) != 1:
        raise SlotError(f"{list(names)!r} are not the segment names of one homepd KV slot pool "
                        "— pass SlotPool.names of the controller's pool")
    return parsed[0][0], parsed[0][1]


def _check_verify(verify: str) -> None:
    if verify not in VERIFY_KINDS:
        raise SlotError(f"verify must be one of {sorted(VERIFY_KINDS)}, not {verify!r}")
