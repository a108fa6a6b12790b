"""A mode's KV handoff: what happens to a request between the worker that prefills it and the one that decodes it.

The topology supplies one (``Topology.make_handoff``), and the controller only tells it what happened:
``NoHandoff`` (colocated, replicas: a request never leaves its worker) does nothing; ``ArenaHandoff``
(disaggregated) owns the KV router over the shared-memory arena, relays ``KVHandoff`` from the prefill worker
to the decode worker and ``KVImported`` back, frees extents as requests end, and says which requests' KV is
still intact in the arena when a worker dies.  The requests themselves (streams, lifecycles, their ends) are
the controller's request table's; the handoff reads and ends them through ``Requests``, the table's part it
is given with each message.
"""
from __future__ import annotations

import time
from typing import Protocol

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Role
from homepd.core.protocol import ExtentFreed, KVHandoff, KVImported
from homepd.core.records import FinishReason

WAKE = ExtentFreed(-1)  # tells the prefill worker that extents may be free again


class Requests(Protocol):
    """What a handoff asks of the requests (``homepd.engine.requests.RequestTable``)."""

    def running(self, request_id: str) -> Lifecycle | None:
        """The lifecycle of a running request (None: not running)."""

    def is_wanted(self, request_id: str) -> bool:
        """Running, and not being cancelled."""

    def moved(self, request_id: str, handle) -> None:
        """Its KV reached ``handle``'s worker, which now holds its prompt."""

    def end(self, rid: str, state: RequestState, t_s: float, reason: FinishReason | None = None, text: str = "",
            error: str | None = None) -> None:
        """End it: its stream gets its last event, what it held is freed (this handoff's ``ended`` too)."""


class NoHandoff:
    """A mode whose requests never move: nothing to relay, free or recover."""
    router = None

    def attach(self, handle, restarted: bool = False) -> None:
        pass

    def on_message(self, requests: Requests, msg) -> None:
        raise AssertionError(f"{type(msg).__name__} in a mode without a KV handoff")

    def ended(self, request_id: str) -> None:
        pass

    def recover(self, role: Role, pid: int | None, resumable: set[str]) -> set[str]:
        return set()

    def resume(self, request_id: str, handle) -> None:
        raise AssertionError("no KV is kept in an arena in this mode")

    def forget(self, request_id: str) -> None:
        pass

    def snapshot(self):
        return None

    def peak_usage(self, t0_s: float, t1_s: float) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


class ArenaHandoff(NoHandoff):
    """Disaggregation: prompts prefilled on the prefill worker reach the decode worker through the KV arena."""

    def __init__(self, router, workers):
        self.router = router      # homepd.kv.router.KVRouter: the extents in transit, the arena's accounting
        self.workers = workers

    def _prefill(self):
        return self.workers[Role.PREFILL]

    def attach(self, handle, restarted: bool = False) -> None:
        """A worker started: it attaches the arena; a restarted prefill worker is woken (extents may have freed
        while it was down)."""
        handle.send(self.router.attach_message())
        if restarted and handle.spec.role is Role.PREFILL:
            handle.send(WAKE)

    def on_message(self, requests: Requests, msg) -> None:
        """``KVHandoff`` from the prefill worker, ``KVImported`` from the decode worker."""
        if isinstance(msg, KVHandoff):
            self._handed_off(requests, msg)
        else:
            self._imported(requests, msg)

    def _handed_off(self, requests: Requests, msg: KVHandoff) -> None:
        """The prefill worker exported a request's KV into an extent: send it on to the decode worker."""
        rid = msg.request_id
        self._prefill().in_flight.discard(rid)
        if not requests.is_wanted(rid):
            self.router.discard_export(msg)  # nobody wants it any more
            self._prefill().send(ExtentFreed(msg.offset))
            requests.end(rid, RequestState.CANCELLED, time.monotonic(), reason=FinishReason.CANCELLED)
            return
        lc = requests.running(rid)
        lc.kv_bytes, lc.kv_extent_wait_s = msg.n_bytes, msg.extent_wait_s
        lc.kv_export_s = msg.export_end_s - msg.export_start_s
        self.router.handed_off(msg)
        decode = self.workers[Role.DECODE]
        if decode.failed:
            requests.end(rid, RequestState.FAILED, time.monotonic(), error=f"decode worker is down ({decode.failed})")
        else:
            decode.send_request(rid, msg)
            requests.moved(rid, decode)  # its next turn is not prefilled anew

    def _imported(self, requests: Requests, msg: KVImported) -> None:
        self.router.imported(msg.request_id)
        self._prefill().send(ExtentFreed(msg.offset))
        lc = requests.running(msg.request_id)
        if lc is not None:
            lc.kv_import_s = msg.import_end_s - msg.import_start_s
            lc.transfer_end_s = msg.import_end_s
            lc.advance(RequestState.DECODING, msg.import_end_s)

    def ended(self, request_id: str) -> None:
        """A request ended: its extent, if it held one, is free again."""
        if self.router.drop(request_id):
            self._prefill().send(WAKE)

    def recover(self, role: Role, pid: int | None, resumable: set[str]) -> set[str]:
        """A worker died: the requests of ``resumable`` whose KV is intact in the arena (resumed from there)."""
        intact = set(self.router.recover(role, pid, resumable))
        self._prefill().send(WAKE)  # recovery may have freed extents
        return intact

    def resume(self, request_id: str, handle) -> None:
        """Send a request whose KV is intact in the arena to the (restarted) decode worker to import."""
        handle.send_request(request_id, self.router.in_arena[request_id])

    def forget(self, request_id: str) -> None:
        """A request is recomputed: a stale extent entry must not be imported later."""
        self.router.drop(request_id)

    def snapshot(self):
        return self.router.snapshot()

    def peak_usage(self, t0_s: float, t1_s: float) -> tuple[int, int]:
        return self.router.peak_usage(t0_s, t1_s)

    def close(self) -> None:
        self.router.close()
