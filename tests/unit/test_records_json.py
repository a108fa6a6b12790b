"""Records read back from their JSON: ``from_dict`` is the exact inverse of ``to_dict``, and any other shape
(a field renamed, missing, added or of another type) raises ``RecordShapeError`` naming the field."""
from __future__ import annotations

import copy
import json

import pytest

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import RESUMED_FROM_EXTENT, Lifecycle, RequestState, RequestTimings
from homepd.core.records import (AdmissionSnapshot, ClassQueue, EngineSnapshot, KVArenaSnapshot, MemoryBreakdown,
                                 ProcessMemoryBreakdown, RecordShapeError, WorkerEvent, WorkerEventKind,
                                 WorkerSnapshot)
from homepd.errors import HomepdError


def full_snapshot() -> EngineSnapshot:
    """Every optional part filled in, every container kind used."""
    workers = (WorkerSnapshot("prefill", 10, True, True, 0, 1, (0,), "", 0, ("a",), 0),
               WorkerSnapshot("decode", 11, True, False, 2, 1, None, "0", 99, ("b", "c"), 3, failed=None))
    arena = KVArenaSnapshot(1 << 20, 4, {"FREE": 0, "WRITING": 1, "READY": 1, "READING": 0}, ("a", "b"),
                            used_bytes=8192, in_transit_kv_bytes=5000, peak_used_bytes=12288, peak_kv_bytes=7000,
                            prefill_n_ctx=512)
    events = (WorkerEvent(WorkerEventKind.DIED, "decode", 9, 1.5, exitcode=-9, cause="SIGKILL",
                          resumed_from_extent=("b",), recomputed_requests=("c",)),
              WorkerEvent(WorkerEventKind.RESTARTED, "decode", 11, 2.0, recovery_s=0.5))
    memory = MemoryBreakdown(100, 200, 300, 400, 500, 600,
                             (ProcessMemoryBreakdown("decode", 11, 1000, 100, 200, 300, 400, 500, 600),))
    admission = AdmissionSnapshot(
        (ClassQueue(RequestClass.INTERACTIVE, 1, 30, 2, 5, 0, 1, 2000.0, 100.0),
         ClassQueue(RequestClass.BACKGROUND, 0, 0, 1, 3, 2, 0, 30000.0, None)),
        {"prefill": 256}, {"prefill": 1234.5}, True, True, ttft_error_mean_ms=12.0, ttft_error_p90_ms=30.0,
        n_predictions=4, routed_local=1, routed_remote=3, route_threshold_tokens=64)
    return EngineSnapshot("disaggregated", "/m/x.gguf", 2048, 64, workers, arena,
                          {"waiting": ("x",), "transferring": ("a", "b")}, 17, events, t_s=123.25,
                          requests_by_class={"interactive": 2, "background": 1}, memory=memory, admission=admission)


def through_json(data: dict) -> dict:
    return json.loads(json.dumps(data))


def test_an_engine_snapshot_comes_back_from_its_json_unchanged():
    snap = full_snapshot()
    back = EngineSnapshot.from_dict(through_json(snap.to_dict()))
    assert back == snap
    assert back.workers[0].cpu_cores == (0,) and back.worker_events[0].kind is WorkerEventKind.DIED
    bare = EngineSnapshot("colocated", None, 512, None, (), None, {}, 0, ())
    assert EngineSnapshot.from_dict(through_json(bare.to_dict())) == bare


@pytest.mark.parametrize("edit, names", [
    (lambda d: d["kv_arena"].update(used=d["kv_arena"].pop("used_bytes")),      # renamed
     ["EngineSnapshot.kv_arena", "missing field(s) used_bytes", "unknown field(s) used"]),
    (lambda d: d["workers"][1].pop("backlog"), ["EngineSnapshot.workers[1]", "missing field(s) backlog"]),
    (lambda d: d.update(n_ctx="2048"), ["EngineSnapshot.n_ctx", "expected int, got str"]),
    (lambda d: d["admission"]["classes"][0].update(admitted=True), ["classes[0].admitted", "expected int"]),
    (lambda d: d["worker_events"][0].update(kind="exploded"), ["worker_events[0].kind", "not a WorkerEventKind"]),
    (lambda d: d.update(requests={"waiting": "x"}), ["EngineSnapshot.requests['waiting']", "expected list"]),
    (lambda d: d["memory"].update(total_bytes=2100), ["EngineSnapshot.memory", "unknown field(s) total_bytes"]),
])
def test_any_other_shape_fails_loudly_naming_the_field(edit, names):
    data = through_json(full_snapshot().to_dict())
    edit(data)
    with pytest.raises(RecordShapeError) as raised:
        EngineSnapshot.from_dict(data)
    assert all(name in str(raised.value) for name in names), str(raised.value)
    assert isinstance(raised.value, HomepdError)


def finished_lifecycle() -> Lifecycle:
    lc = Lifecycle("r1", arrived_s=10.0, n_prompt_tokens=100, request_class="background")
    lc.advance(RequestState.PREFILLING, 10.5)
    lc.prefill_end_s = 11.0
    lc.advance(RequestState.TRANSFERRING, 11.0)
    lc.kv_bytes, lc.kv_export_s, lc.kv_import_s, lc.kv_extent_wait_s = 2_000_000, 0.001, 0.002, 0.0
    lc.transfer_end_s = 11.01
    lc.advance(RequestState.DECODING, 11.01)
    for t in (11.1, 11.2, 11.3):
        lc.add_token(t)
    lc.advance(RequestState.FINISHED, 11.3)
    return lc


def test_request_timings_are_one_shape_inside_the_lifecycle_s_json_and_on_their_own():
    lc = finished_lifecycle()
    timings = lc.timings()
    assert (timings.state, timings.n_output_tokens, timings.kv_bytes) == (RequestState.FINISHED, 3, 2_000_000)
    assert timings.request_class is RequestClass.BACKGROUND
    assert timings.e2e_s == pytest.approx(1.3) and timings.kv_transfer_s == pytest.approx(0.01)
    assert RequestTimings.from_dict(through_json(timings.to_dict())) == timings
    as_json = through_json(lc.to_dict())
    assert RequestTimings.from_lifecycle_dict(as_json) == timings
    assert as_json["arrived_s"] == 10.0 and as_json["resumed_by"] == []   # the lifecycle's own fields beside


def test_a_lifecycle_json_without_one_of_the_figures_is_refused():
    as_json = through_json(finished_lifecycle().to_dict())
    renamed = copy.deepcopy(as_json)
    renamed["transfer_s"] = renamed.pop("kv_transfer_s")
    with pytest.raises(RecordShapeError, match="request r1: missing field.*kv_transfer_s"):
        RequestTimings.from_lifecycle_dict(renamed)
    with pytest.raises(RecordShapeError, match="RequestTimings: unknown field.*arrived_s"):
        RequestTimings.from_dict(as_json)   # the figures alone are exact: no lifecycle fields in them


def test_a_field_renamed_from_slot_to_extent_is_served_under_both_names_and_read_from_either():
    """The arena's slots became extents: JSON keeps each old field name beside the new one (readers of /status,
    /events and stored runs), and records read back from either name alone, as older homepd wrote them."""
    snap = through_json(full_snapshot().to_dict())
    event = snap["worker_events"][0]
    assert event["resumed_from_extent"] == event["resumed_from_slot"] == ["b"]
    for name in ("resumed_from_extent", "resumed_from_slot"):
        one = copy.deepcopy(snap)
        one["worker_events"][0].pop(name)
        assert EngineSnapshot.from_dict(one) == full_snapshot()
    lc = finished_lifecycle()
    as_json = through_json(lc.to_dict())
    assert as_json["kv_extent_wait_s"] == as_json["kv_slot_wait_s"] == 0.0
    old = {k: v for k, v in as_json.items() if k != "kv_extent_wait_s"}
    assert RequestTimings.from_lifecycle_dict(old) == lc.timings()
    timings = through_json(lc.timings().to_dict())
    timings.pop("kv_extent_wait_s")
    assert RequestTimings.from_dict(timings) == lc.timings()
    with pytest.raises(RecordShapeError, match="missing field.*kv_extent_wait_s"):
        RequestTimings.from_lifecycle_dict({k: v for k, v in old.items() if k != "kv_slot_wait_s"})
    lc.resumed_by.append(RESUMED_FROM_EXTENT)
    assert through_json(lc.to_dict())["resumed_by"] == ["slot"]  # the value keeps its old name too
