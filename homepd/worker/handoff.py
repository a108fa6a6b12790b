"""The disaggregated roles of a worker: KV handoff through the shared-memory KV arena.

``PrefillRole``: when a prompt's first token is out, take an extent of exactly
``llama_state_seq_get_size`` bytes plus its header from the arena (its own
``RingAllocator``), export the sequence's KV state straight into it
(``llama_state_seq_get_data`` writes into the shared mapping, no intermediate
bytes), publish it and tell the controller.  No room = back-pressure: the
sequence keeps its KV here and waits (an ``ExtentFreed`` message wakes the loop;
the bytes come back when the extent's state byte reads FREE).  A state that
could never fit the arena fails its request with the sizes — the controller
normally routes such a prompt to the decode worker before it gets here.

``DecodeRole``: a ``KVHandoff`` from the controller is imported into a free
sequence (``llama_state_seq_set_data`` from the extent), the extent freed, and
the request continues in the decode batch with its text stream and a sampler built again from its
parameters and output so far.

Both get only what they use: the context, the controller's ``send``, the
loop's ``finish`` (a sequence leaves this worker) and, for the decode role,
the scheduler that admits imported requests.  The arena comes with the
controller's ``AttachExtents`` message.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from homepd.core.protocol import AttachExtents, ExtentFreed, KVHandoff, KVImported, RequestDone
from homepd.core.scheduler import Scheduler
from homepd.core.records import FinishReason
from homepd.core.sequence import Sequence
from homepd.errors import HomepdError
from homepd.kv.header import ExtentExpectation, ExtentHeader, ExtentState
from homepd.kv.pool import KVArena, extent_bytes_for
from homepd.kv.ring import RingAllocator
from homepd.kv.segment import unlink_pool_of

_IN_USE = (ExtentState.WRITING, ExtentState.READY, ExtentState.READING)


class _ArenaRole:
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, arena: KVArena | None = None):
        self.ctx, self.send, self.finish = ctx, send, finish
        self.model_fingerprint = model_fingerprint
        self.arena = arena

    def handle(self, msg) -> bool:
        if isinstance(msg, AttachExtents):
            if self.arena is not None:
                self.arena.close()
            self.arena = KVArena.attach(msg.names)
            self._attached(msg)
            return True
        return isinstance(msg, ExtentFreed)  # only wakes the loop

    def _attached(self, msg: AttachExtents) -> None:
        pass

    def abandon(self) -> None:
        """Controller gone: unlink its arena segment (it cannot any more)."""
        if self.arena is not None:
            unlink_pool_of(self.arena.owner_pid, self.arena.token)
            self.arena.close()
            self.arena = None

    def _fail(self, request_id: str, error: str) -> None:
        self.send(RequestDone(request_id, FinishReason.ERROR, time.monotonic(), error=error))


class PrefillRole(_ArenaRole):
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, arena: KVArena | None = None, max_extents: int | None = None):
        super().__init__(ctx, send, finish, model_fingerprint, arena)
        self.waiting: deque[tuple[Sequence, float]] = deque()  # (seq, prompt done at)
        self.allocator: RingAllocator | None = None
        self._payload_bytes: dict[int, int] = {}  # live extent offset -> its KV payload bytes
        if arena is not None:
            self._attached(AttachExtents(arena.names, max_extents=max_extents))

    def _attached(self, msg: AttachExtents) -> None:
        """A new arena, or this worker restarted: the allocator starts from what is still in transit."""
        self.allocator = RingAllocator(self.arena.capacity_bytes, max_extents=msg.max_extents)
        self._payload_bytes = {}
        for offset, n_bytes in msg.live_extents:
            self.allocator.reserve(offset, n_bytes)
            header = self.arena.header_at(offset)
            self._payload_bytes[offset] = header.payload_bytes if header is not None else 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def prompt_done(self, seq: Sequence, t_s: float) -> None:
        self.waiting.append((seq, t_s))

    def forget(self, seq: Sequence) -> None:
        self.waiting = deque(item for item in self.waiting if item[0] is not seq)

    def cancel(self, request_id: str) -> None:
        pass  # not here any more: the controller handles a request already handed off

    def pump(self) -> None:
        """Export waiting sequences while the arena has room (oldest first)."""
        while self.waiting and self.arena is not None:
            self.reclaim()
            seq, done_s = self.waiting[0]
            n_bytes = self.ctx.state_size(seq.seq_id)
            extent = extent_bytes_for(n_bytes)
            if not self.allocator.can_ever_fit(extent):
                self.waiting.popleft()
                self._fail(seq.request_id, f"its KV state is {n_bytes} bytes ({extent} with the extent header), "
                                           f"the KV arena holds {self.arena.capacity_bytes}: it can never fit — "
                                           "start homepd with a larger --kv-arena")
                self.finish(seq)
                continue
            offset = self.allocator.alloc(extent)
            if offset is None:
                return  # back-pressure: wait for ExtentFreed
            self.waiting.popleft()
            self._export(seq, offset, extent, n_bytes, time.monotonic() - done_s)

    def reclaim(self) -> None:
        """Give back to the allocator every extent whose state byte no longer says it is in use."""
        for offset in self.allocator.live:
            if self.arena.state(offset) not in _IN_USE:
                self.allocator.free(offset)
                self._payload_bytes.pop(offset, None)

    def _export(self, seq: Sequence, offset: int, extent: int, n_bytes: int, wait_s: float) -> None:
        ctx, arena = self.ctx, self.arena
        try:
            arena.begin(offset, extent)
            t0 = time.monotonic()
            written = ctx.state_get(seq.seq_id, arena.payload(offset, n_bytes, seq.request_id))
            t1 = time.monotonic()
            arena.publish(offset, ExtentHeader(request_id=seq.request_id, model_fingerprint=self.model_fingerprint,
                                               n_ctx=ctx.n_ctx, n_tokens=seq.n_kv_tokens, payload_bytes=written,
                                               export_start_s=t0, export_end_s=t1))
        except HomepdError as exc:
            arena.release(offset)
            self.allocator.free(offset)
            self._fail(seq.request_id, f"KV export failed: {exc}")
            self.finish(seq)
            return
        self._payload_bytes[offset] = written
        self.send(KVHandoff(
            request_id=seq.request_id, offset=offset, prompt_ids=tuple(seq.prompt_ids),
            output_ids=tuple(seq.output_ids), params=seq.params, stream=seq.stream, n_bytes=written,
            n_tokens=seq.n_kv_tokens, extent_wait_s=wait_s, export_start_s=t0, export_end_s=t1, extent_bytes=extent,
            arena_used_bytes=self.allocator.used_bytes, arena_kv_bytes=sum(self._payload_bytes.values()),
            request_class=seq.request_class))
        self.finish(seq, keep_prefix=True)  # its KV may stay here as a cached prefix


class DecodeRole(_ArenaRole):
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, scheduler: Scheduler, arena: KVArena | None = None):
        super().__init__(ctx, send, finish, model_fingerprint, arena)
        self.scheduler = scheduler
        self.pending: deque[KVHandoff] = deque()

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def handle(self, msg) -> bool:
        if isinstance(msg, KVHandoff):
            self.pending.append(msg)
            return True
        return super().handle(msg)

    def prompt_done(self, seq: Sequence, t_s: float) -> None:
        pass  # an imported request already has its first token

    def forget(self, seq: Sequence) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        for msg in list(self.pending):
            if msg.request_id == request_id:
                self.pending.remove(msg)
                if self.arena is not None and self.arena.request_in(msg.offset) == request_id:
                    self.arena.reset_stale(msg.offset)
                self.send(RequestDone(request_id, FinishReason.CANCELLED, time.monotonic()))

    def pump(self) -> None:
        """Import pending handoffs while sequences and context are free (in arrival order)."""
        while self.pending and self.arena is not None:
            msg = self.pending[0]
            seq = Sequence(request_id=msg.request_id, prompt_ids=list(msg.prompt_ids), params=msg.params,
                           n_prefilled=len(msg.prompt_ids), output_ids=list(msg.output_ids),
                           stream=msg.stream, request_class=msg.request_class)
            if not self.scheduler.can_admit(seq):
                return  # back-pressure: the extent stays READY until a sequence frees
            self.pending.popleft()
            self.scheduler.admit(seq)
            try:
                t0 = time.monotonic()
                seq.sampler = self.ctx.new_sampler(msg.params, msg.output_ids)
                header, view = self.arena.open_ready(msg.offset, ExtentExpectation(
                    request_id=msg.request_id, model_fingerprint=self.model_fingerprint, n_ctx=self.ctx.n_ctx),
                    msg.extent_bytes)
                self.ctx.state_set(seq.seq_id, view, header.payload_bytes)
                t1 = time.monotonic()
            except HomepdError as exc:
                self._fail(msg.request_id, f"KV import refused: {exc}")
                self.finish(seq)
                if self._extent_of(msg) in (ExtentState.READY, ExtentState.READING):
                    self.arena.reset_stale(msg.offset)  # never free an extent that already holds another request
                continue
            self.arena.release(msg.offset)
            self.send(KVImported(msg.request_id, msg.offset, t0, t1))

    def _extent_of(self, msg: KVHandoff) -> ExtentState | None:
        """The state of msg's extent if it is still msg's (its header names msg's request, or is unreadable)."""
        try:
            state = self.arena.state(msg.offset)
        except HomepdError:  # the offset is not even inside the arena
            return None
        return state if self.arena.request_in(msg.offset) in (msg.request_id, None) else None
