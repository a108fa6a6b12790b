"""Controller side of disaggregation: the KV slot pool and the requests in transit.

The controller owns the pool (creates, pre-faults, unlinks).  A request is
"in a slot" from the prefill worker's ``KVHandoff`` until the decode worker's
``KVImported`` (or its end).  After any worker death the router puts every
slot back in order — nothing stays WRITING/READY/READING without a request
that will use it — and names the requests the restarted decode worker can
resume from their slot without a second prefill.
"""
from __future__ import annotations

from homepd.kv.header import SlotState
from homepd.kv.pool import SlotPool
from homepd.core.protocol import AttachSlots, KVHandoff, WorkerReady

SLOT_SLACK_BYTES = 1 << 20


class KVRouter:
    def __init__(self, n_slots: int, n_ctx: int, prefill_ready: WorkerReady):
        capacity = prefill_ready.state_overhead_bytes + prefill_ready.state_bytes_per_token * n_ctx + SLOT_SLACK_BYTES
        self.pool = SlotPool.create(n_slots, capacity)
        self.in_slot: dict[str, KVHandoff] = {}

    def attach_message(self) -> AttachSlots:
        return AttachSlots(tuple(self.pool.names))

    def close(self) -> None:
        self.pool.close()  # the owner unlinks

    def handed_off(self, msg: KVHandoff) -> None:
        self.in_slot[msg.request_id] = msg

    def imported(self, request_id: str) -> None:
        self.in_slot.pop(request_id, None)

    def drop(self, request_id: str) -> bool:
        """The request ended: if its KV still waits in a slot nobody will import, free the slot.

        Returns True if the request was in a slot (the prefill worker may have room now).
        """
        msg = self.in_slot.pop(request_id, None)
        if msg is None:
            return False
        if self.pool.state(msg.slot) == SlotState.READY and self.pool.request_in(msg.slot) == request_id:
            self.pool.reset_stale(msg.slot)
        return True

    def discard_export(self, msg: KVHandoff) -> None:
        """An export nobody wants (cancelled meanwhile): free its slot."""
        if self.pool.request_in(msg.slot) == msg.request_id:
            self.pool.reset_stale(msg.slot)

    def recover(self, role: str, dead_pid: int, resumable_ids: set[str]) -> list[str]:
        """Put slots back in order after ``dead_pid`` (a ``role`` worker) died.

        ``resumable_ids``: requests the dead decode worker held that are still wanted.
        Returns those whose KV is intact in their slot (to re-send to the restarted worker).
        """
        resumed = []
        for slot in range(len(self.pool)):
            state, holder = self.pool.state(slot), self.pool.holder_pid(slot)
            owner = self.pool.request_in(slot)
            if state == SlotState.WRITING and holder == dead_pid:
                self.pool.reset_stale(slot)  # a half-written export
            elif state == SlotState.READING and holder == dead_pid:
                if owner in resumable_ids and self.in_slot.get(owner, None) is not None \
                        and self.in_slot[owner].slot == slot:
                    self.pool.reset_stale(slot, to=SlotState.READY)  # intact: import it again
                else:
                    self.pool.reset_stale(slot)
            elif state == SlotState.READY and role == "prefill" and owner not in self.in_slot:
                # published, but its producer died before the handoff reached us: nobody will import it
                self.pool.reset_stale(slot)
        if role == "decode":
            for rid in sorted(resumable_ids):
                msg = self.in_slot.get(rid)
                if msg is not None and self.pool.state(msg.slot) == SlotState.READY \
                        and self.pool.request_in(msg.slot) == rid:
                    resumed.append(rid)
        return resumed
