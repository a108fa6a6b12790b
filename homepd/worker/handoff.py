"""The disaggregated roles of a worker: KV handoff through shared-memory slots.

``PrefillRole``: when a prompt's first token is out, export the sequence's
KV state straight into a free slot (``llama_state_seq_get_data`` writes into
the shared mapping, no intermediate bytes), publish the slot and tell the
controller.  No free slot = back-pressure: the sequence keeps its KV here and
waits (a ``SlotFreed`` message wakes the loop).

``DecodeRole``: a ``KVHandoff`` from the controller is imported into a free
sequence (``llama_state_seq_set_data`` from the slot), the slot freed, and the
request continues in the decode batch with its sampler and text stream.

Both get only what they use: the context, the controller's ``send``, the
loop's ``finish`` (a sequence leaves this worker) and, for the decode role,
the scheduler that admits imported requests.  The slot pool comes with the
controller's ``AttachSlots`` message.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from homepd.errors import HomepdError
from homepd.kv.header import SlotExpectation, SlotHeader
from homepd.kv.segment import unlink_pool_of
from homepd.kv.pool import SlotPool
from homepd.core.protocol import AttachSlots, KVHandoff, KVImported, RequestDone, SlotFreed
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence


class _SlotRole:
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, pool: SlotPool | None = None):
        self.ctx, self.send, self.finish = ctx, send, finish
        self.model_fingerprint = model_fingerprint
        self.pool = pool

    def handle(self, msg) -> bool:
        if isinstance(msg, AttachSlots):
            if self.pool is not None:
                self.pool.close()
            self.pool = SlotPool.attach(list(msg.names))
            return True
        return isinstance(msg, SlotFreed)  # only wakes the loop

    def abandon(self) -> None:
        """Controller gone: unlink its slot segments (it cannot any more)."""
        if self.pool is not None:
            unlink_pool_of(self.pool.owner_pid, self.pool.token)
            self.pool.close()
            self.pool = None

    def _fail(self, request_id: str, error: str) -> None:
        self.send(RequestDone(request_id, "error", time.monotonic(), error=error))


class PrefillRole(_SlotRole):
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, pool: SlotPool | None = None):
        super().__init__(ctx, send, finish, model_fingerprint, pool)
        self.waiting: deque[tuple[Sequence, float]] = deque()  # (seq, prompt done at)

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
        """Export waiting sequences while slots are free (oldest first)."""
        while self.waiting and self.pool is not None:
            slot = self.pool.acquire_free()
            if slot is None:
                return  # back-pressure: wait for SlotFreed
            seq, done_s = self.waiting.popleft()
            self._export(seq, slot, time.monotonic() - done_s)

    def _export(self, seq: Sequence, slot: int, wait_s: float) -> None:
        ctx, pool = self.ctx, self.pool
        try:
            n_bytes = ctx.state_size(seq.seq_id)
            t0 = time.monotonic()
            written = ctx.state_get(seq.seq_id, pool.payload(slot, n_bytes, seq.request_id))
            t1 = time.monotonic()
            pool.publish(slot, SlotHeader(request_id=seq.request_id, model_fingerprint=self.model_fingerprint,
                                          n_ctx=ctx.n_ctx, n_tokens=seq.n_kv_tokens, payload_bytes=written,
                                          export_start_s=t0, export_end_s=t1))
        except HomepdError as exc:
            pool.release(slot)
            self._fail(seq.request_id, f"KV export failed: {exc}")
            self.finish(seq)
            return
        self.send(KVHandoff(
            request_id=seq.request_id, slot=slot, prompt_ids=tuple(seq.prompt_ids), output_ids=tuple(seq.output_ids),
            params=seq.params, sampler=seq.sampler, stream=seq.stream, n_bytes=written,
            n_tokens=seq.n_kv_tokens, slot_wait_s=wait_s, export_start_s=t0, export_end_s=t1))
        self.finish(seq)


class DecodeRole(_SlotRole):
    def __init__(self, ctx, send: Callable[[object], None], finish: Callable[[Sequence], None],
                 model_fingerprint: str, scheduler: Scheduler, pool: SlotPool | None = None):
        super().__init__(ctx, send, finish, model_fingerprint, pool)
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
                if self.pool is not None and self.pool.request_in(msg.slot) == request_id:
                    self.pool.reset_stale(msg.slot)
                self.send(RequestDone(request_id, "cancelled", time.monotonic()))

    def pump(self) -> None:
        """Import pending handoffs while sequences and context are free (in arrival order)."""
        while self.pending and self.pool is not None:
            msg = self.pending[0]
            seq = Sequence(request_id=msg.request_id, prompt_ids=list(msg.prompt_ids), params=msg.params,
                           n_prefilled=len(msg.prompt_ids), output_ids=list(msg.output_ids),
                           sampler=msg.sampler, stream=msg.stream)
            if not self.scheduler.can_admit(seq):
                return  # back-pressure: the slot stays READY until a sequence frees
            self.pending.popleft()
            self.scheduler.admit(seq)
            try:
                t0 = time.monotonic()
                header, view = self.pool.open_ready(msg.slot, SlotExpectation(
                    request_id=msg.request_id, model_fingerprint=self.model_fingerprint, n_ctx=self.ctx.n_ctx))
                self.ctx.state_set(seq.seq_id, view, header.payload_bytes)
                t1 = time.monotonic()
            except HomepdError as exc:
                self._fail(msg.request_id, f"KV import refused: {exc}")
                self.finish(seq)
                if self.pool.state(msg.slot).name in ("READY", "READING") and \
                        self.pool.request_in(msg.slot) in (msg.request_id, None):
                    self.pool.reset_stale(msg.slot)  # never free a slot that already holds another request
                continue
            self.pool.release(msg.slot)
            self.send(KVImported(msg.request_id, msg.slot, t0, t1))
