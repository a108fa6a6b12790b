"""The request table (``homepd.engine.requests``) on constructed handles: no processes, no loop.

What the controller relays to it (steps, ends, cancels) and what the disaggregated handoff asks of it through
``Requests`` (``homepd.engine.topology.handoff``)."""
from __future__ import annotations

from types import SimpleNamespace

from homepd.config import EngineConfig
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.modes import Role
from homepd.core.protocol import (CancelRequest, ExtentFreed, KVHandoff, KVImported, RequestDone, StepRecord,
                                  StepReport, TokenOut)
from homepd.core.records import FinishReason, PrefixCacheStats
from homepd.core.sampling import SamplingParams
from homepd.engine.affinity import PrefixAffinity
from homepd.engine.gate import AdmissionGate
from homepd.engine.requests import MAX_RECORDS, RequestTable
from homepd.engine.streams import EventKind, RequestStream
from homepd.engine.topology.handoff import ArenaHandoff


class Handle:
    """The part of a ``WorkerHandle`` the table and the handoff touch."""

    def __init__(self, name: str, role: Role = Role.COLOCATED):
        self.role, self.spec = name, SimpleNamespace(role=role, n_ctx=4096)
        self.in_flight: set[str] = set()
        self.backlog: list[tuple[str, object]] = []
        self.cache_stats = self.failed = None
        self.kv_range = 0
        self.sent: list = []

    def send_request(self, rid: str, msg) -> None:
        self.in_flight.add(rid)
        self.sent.append(msg)

    def drop_backlog(self, rid: str) -> bool:
        kept = [item for item in self.backlog if item[0] != rid]
        dropped, self.backlog = len(kept) < len(self.backlog), kept
        return dropped

    def send(self, msg) -> None:
        self.sent.append(msg)


class Router:
    """The KV router's part the handoff calls, recorded."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def discard_export(self, msg):
        self.calls.append(("discard", msg.request_id))

    def handed_off(self, msg):
        self.calls.append(("handed_off", msg.request_id))

    def imported(self, rid):
        self.calls.append(("imported", rid))

    def drop(self, rid) -> bool:
        self.calls.append(("drop", rid))
        return False


def table_with(*handles: Handle) -> RequestTable:
    workers = {h.role: h for h in handles}
    return RequestTable(workers, AdmissionGate(EngineConfig(backend="fake")), PrefixAffinity(), n_seq_max=4)


def admit(table: RequestTable, rid: str, handle: Handle, prompt=(1, 2, 3)) -> RequestStream:
    stream = RequestStream(rid, Lifecycle(request_id=rid, arrived_s=0.0, n_prompt_tokens=len(prompt)), tuple(prompt),
                           SamplingParams(max_tokens=8))
    table.add(stream)
    handle.send_request(rid, object())
    return stream


def events(stream: RequestStream) -> list:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return out


def test_a_step_streams_its_tokens_then_its_ends_and_its_listeners_hear_of_it_last():
    worker = Handle("colocated")
    table = table_with(worker)
    stream = admit(table, "a", worker)
    heard = []
    table.step_listeners.append(lambda step: heard.append((step, table.is_wanted("a"))))
    step = StepRecord("colocated", 0, 1.0, 1.1, ("a",), (("a", 3),))
    table.step(worker, StepReport(step, prefill_started=("a",), prefill_ended=("a",),
                                  tokens=(TokenOut("a", 7, "x", 1.1), TokenOut("a", 8, "y", 1.1)),
                                  done=(RequestDone("a", FinishReason.STOP, 1.1),)))
    assert [(e.kind, e.token_id) for e in events(stream)] == [(EventKind.TOKEN, 7), (EventKind.TOKEN, 8),
                                                             (EventKind.DONE, None)]
    assert stream.lifecycle.state is RequestState.FINISHED and stream.lifecycle.n_prefilled == 3
    assert heard == [(step, False)] and table.steps_since() == [step]
    assert "a" not in table and not worker.in_flight and table.finished_since(0.0) == [stream.lifecycle]
    assert table.affinity.cached(worker, (1, 2, 3, 7, 8, 9)) == 5  # its worker keeps prompt + output


def test_a_worker_s_load_counts_the_cells_its_latest_step_said_its_cached_prefixes_hold_and_its_range():
    worker = Handle("colocated")
    table = table_with(worker)
    admit(table, "a", worker, prompt=(1, 2, 3, 4))
    assert table.worker_load(worker).idle_cells == 0   # no step yet, no cache reported
    table.step(worker, StepReport(StepRecord("colocated", 0, 1.0, 1.1, (), (("a", 4),), kv_in_use=1024),
                                  prefill_started=("a",), cache=PrefixCacheStats(n_cached_entries=2, n_cached_cells=600)))
    load = table.worker_load(worker)
    assert load.idle_cells == 600 and load.kv_in_use == 4 and load.n_seqs == 1 and load.kv_range == 1024
    assert table.load(worker.in_flight).idle_cells == 0   # the requests alone, without the worker's cache


def test_a_replicas_step_is_named_after_its_worker():
    worker = Handle("replica-1")
    table = table_with(worker)
    table.step(worker, StepReport(StepRecord("colocated", 0, 1.0, 1.1, (), ())))
    assert [s.worker_role for s in table.last_steps(1)] == ["replica-1"]


def test_a_cancel_ends_a_request_still_in_the_backlog_at_once_and_asks_a_worker_that_holds_it():
    worker = Handle("colocated")
    table = table_with(worker)
    waiting, running = admit(table, "w", worker), admit(table, "r", worker)
    worker.backlog.append(("w", object()))
    assert table.cancel("w") and table.cancel("r") and not table.cancel("gone")
    assert [e.finish_reason for e in events(waiting)] == [FinishReason.CANCELLED]
    assert [m.request_id for m in worker.sent if isinstance(m, CancelRequest)] == ["r"]
    assert "r" in table and not table.is_wanted("r") and events(running) == []
    table.done(RequestDone("r", FinishReason.CANCELLED, 2.0))
    assert [e.finish_reason for e in events(running)] == [FinishReason.CANCELLED]
    assert not table.cancelling and not worker.in_flight


def test_a_failure_is_the_last_event_and_the_table_keeps_only_the_newest_records():
    worker = Handle("colocated")
    table = table_with(worker)
    for i in range(MAX_RECORDS + 2):
        admit(table, f"q{i}", worker)
        table.end(f"q{i}", RequestState.FAILED, float(i), error="worker died")
    assert [lc.request_id for lc in table.finished_since(MAX_RECORDS - 0.5)] == [f"q{MAX_RECORDS}",
                                                                                f"q{MAX_RECORDS + 1}"]
    assert len(table.records) == MAX_RECORDS and "q0" not in table.records
    stream = admit(table, "z", worker)
    table.end("z", RequestState.FAILED, 5.0, error="worker died")
    assert [(e.kind, e.error) for e in events(stream)] == [(EventKind.ERROR, "worker died")]


def handoff(rid: str) -> KVHandoff:
    return KVHandoff(rid, 4096, (1, 2, 3), (), SamplingParams(), None, 1000, 3, 0.01, 1.0, 1.02)


def test_the_handoff_sends_a_wanted_request_on_and_frees_an_unwanted_one_through_the_table():
    prefill, decode = Handle("prefill", Role.PREFILL), Handle("decode", Role.DECODE)
    table = table_with(prefill, decode)
    router = Router()
    table.handoff = arena = ArenaHandoff(router, table.workers)
    wanted, cancelled = admit(table, "a", prefill), admit(table, "b", prefill)
    table.cancel("b")
    arena.on_message(table, handoff("a"))
    arena.on_message(table, handoff("b"))
    assert "a" in decode.in_flight and "a" not in prefill.in_flight and wanted.lifecycle.kv_bytes == 1000
    assert table.affinity.cached(decode, (1, 2, 3, 4)) == 3  # the decode worker now holds its prompt
    assert [e.finish_reason for e in events(cancelled)] == [FinishReason.CANCELLED]
    assert ("discard", "b") in router.calls and ("drop", "b") in router.calls  # the end told the handoff
    assert ExtentFreed(4096) in prefill.sent
    wanted.lifecycle.advance(RequestState.PREFILLING, 1.0)
    wanted.lifecycle.advance(RequestState.TRANSFERRING, 1.0)
    arena.on_message(table, KVImported("a", 4096, 1.03, 1.05))
    assert wanted.lifecycle.state is RequestState.DECODING and wanted.lifecycle.transfer_end_s == 1.05
