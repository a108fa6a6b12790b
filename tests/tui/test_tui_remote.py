"""The remote data source against the routes of ``homepd serve``, served by an in-process httpx transport."""
from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from homepd.config import EngineConfig
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.protocol import StepRecord
from homepd.core.records import PrefixCacheStats
from homepd.chat.reply import Delta, DeltaKind, ToolCall
from homepd.core.records import EngineSnapshot, RecordShapeError, WorkerSnapshot
from homepd.errors import HomepdError
from homepd.measure.stepstream import StepSample, TokenGaps
from homepd.tui.sources.chatrequest import chunk_deltas
from homepd.tui.sources.remote import RemoteSource, find_service, iter_sse, service_address
from homepd.tui.state import ChatTurn
from homepd.core.terms import ReuseMode

pytestmark = pytest.mark.timeout(30)
KEY = "secret-key-123"


def engine_json() -> dict:
    w = WorkerSnapshot("colocated", 42, True, True, 0, 2, (0, 1), "", 0, ("r1",), 0)
    cache = PrefixCacheStats(n_lookups=3, n_hits=2, n_lookup_tokens=90, n_hit_tokens=60, cached_bytes=3 << 20,
                             mode=ReuseMode.PREFIX)
    return EngineSnapshot("colocated", "/m/smollm2.gguf", 4096, 256, (w,), None, {"decoding": ("r1",)}, 5,
                          (), cache={"colocated": cache}).to_dict()


def status() -> dict:
    return {"state": "ready", "ready": True, "models": ["smollm2-135m-instruct-q4_1"],
            "served_models": [{"name": "smollm2-135m-instruct-q4_1:latest", "role": "chat", "state": "loaded",
                               "expires_at": "2318-01-01T00:00:00+00:00"}],
            "admission": {"in_flight": 1, "capacity": 24}, "engine": engine_json(), "recent_requests": []}


def finished(request_id: str, ttft_s: float, n_tokens: int, n_cached: int = 0) -> Lifecycle:
    """A request that ended: first token ``ttft_s`` after arrival, then one every 50 ms."""
    lc = Lifecycle(request_id, arrived_s=100.0, n_prompt_tokens=9)
    lc.n_cached_tokens = n_cached
    lc.advance(RequestState.PREFILLING, 100.0)
    lc.advance(RequestState.DECODING, 100.0 + ttft_s)
    for k in range(n_tokens):
        lc.add_token(100.0 + ttft_s + 0.05 * k)
    lc.advance(RequestState.FINISHED, 100.0 + ttft_s + 0.05 * n_tokens)
    return lc


RENAME: dict = {}   # a test sets {"old": "new"} for a field of the engine snapshot the service sends
EVENTS: list = []   # a test sets the (name, data) events /events sends before its snapshot
CHAT_BODIES: list = []  # the chat requests the service received
ADVICE: dict | None = None  # a test sets the standing advice GET /advice returns (None: 404, as --no-advice)


def engine_status() -> dict:
    body = {k: v for k, v in status().items() if k != "recent_requests"}
    for old, new in RENAME.items():
        body["engine"][new] = body["engine"].pop(old)
    return body


def sse(*events: tuple[str | None, str]) -> bytes:
    return "".join((f"event: {name}\n" if name else "") + f"data: {data}\n\n" for name, data in events).encode()


def service(request: httpx.Request) -> httpx.Response:
    if request.headers.get("authorization") != f"Bearer {KEY}":
        return httpx.Response(401, json={"error": {"message": "missing or wrong API key"}})
    if request.url.path == "/status":
        return httpx.Response(200, json=status())
    if request.url.path == "/advice/apply":
        name = json.loads(request.content)["candidate"]
        if name != "disaggregated-routed":
            return httpx.Response(409, json={"error": {"message": f"no measured candidate {name!r} to switch to"}})
        return httpx.Response(200, json={"kind": "switch-applied", "candidate": name, "took_s": 1.8,
                                         "configuration": {"line": "disaggregated: prefill + decode"}})
    if request.url.path == "/advice" and ADVICE is not None:
        return httpx.Response(200, json={"advice": ADVICE, "history": []})
    if request.url.path == "/events" and EVENTS:
        return httpx.Response(200, content=sse(*EVENTS, ("snapshot", json.dumps(engine_status()))),
                              headers={"content-type": "text/event-stream"})
    if request.url.path == "/events":
        request_done = finished("chatcmpl-1", 0.3, 4).to_dict()     # what homepd serve publishes
        return httpx.Response(200, content=sse(("request", json.dumps(request_done)),
                                               ("snapshot", json.dumps(engine_status()))),
                              headers={"content-type": "text/event-stream"})
    if request.url.path == "/v1/chat/completions":
        body = json.loads(request.content)
        CHAT_BODIES.append(body)
        assert body["stream"] and body["model"] == "smollm2-135m-instruct-q4_1"
        chunk = lambda choice, **kw: json.dumps({"choices": [choice], **kw})  # noqa: E731
        delta = lambda **d: (None, chunk({"delta": d, "finish_reason": None}))  # noqa: E731
        if body.get("tools"):  # a thinking model that calls the tool, as homepd serve streams it
            call = {"index": 0, "id": "call_abc", "type": "function",
                    "function": {"name": "get_current_time", "arguments": ""}}
            pieces = [delta(role="assistant", content=""), delta(reasoning_content="The user wants "),
                      delta(reasoning_content="the time."), delta(content="Checking."), delta(tool_calls=[call]),
                      delta(tool_calls=[{"index": 0, "function": {"arguments": '{"timezone":'}}]),
                      delta(tool_calls=[{"index": 0, "function": {"arguments": '"UTC"}'}}])]
            finish = "tool_calls"
        else:
            pieces, finish = [delta(role="assistant", content=""), delta(content="Hel"), delta(content="lo")], "stop"
        return httpx.Response(200, content=sse(
            *pieces,
            (None, chunk({"delta": {}, "finish_reason": finish},  # homepd serve's homepd object
                         homepd={"mode": "colocated", **finished("chatcmpl-2", 0.12, 2, n_cached=6).timings().to_dict()})),
            (None, "[DONE]")), headers={"content-type": "text/event-stream"})
    return httpx.Response(404)


def make(api_key: str = KEY) -> RemoteSource:
    return RemoteSource("http://homepd.test", EngineConfig(), api_key=api_key,
                        transport=httpx.MockTransport(service), sample_hardware=False)


def test_sse_lines_become_named_events():
    lines = ["event: snapshot", "data: {\"a\": 1}", "", ": comment", "data: x", "data: y", ""]
    assert list(iter_sse(lines)) == [("snapshot", '{"a": 1}'), ("message", "x\ny")]


def test_the_dashboard_follows_the_status_and_event_stream():
    source = make()
    try:
        source.start(lambda message: None)
        assert source.wait_live(10)
        tick = source.tick()
        assert tick.architecture.mode == "colocated" and tick.architecture.n_running == 1
        assert tick.architecture.note == "service ready; 1 in flight of at most 24"
        (cache,) = tick.architecture.caches  # /status's typed cache stats, per worker
        assert (cache.worker, cache.hit_ratio, cache.cached_bytes) == ("colocated", pytest.approx(2 / 3), 3 << 20)
        assert [r.request_id for r in tick.requests] == ["chatcmpl-1"] and tick.requests[0].ttft_ms == pytest.approx(300.0)
        assert tick.point.ttft_ms == pytest.approx(300.0) and tick.point.interference is None   # no steps sent
        assert tick.requests[0].itl_max_ms is None and tick.requests[0].stall == ""            # (an older service)
        assert "remote: homepd serve at http://homepd.test (ready, live)" == tick.status
        assert [(m.name, m.role, m.state) for m in tick.models] == [("smollm2-135m-instruct-q4_1:latest", "chat",
                                                                      "loaded")]
    finally:
        source.stop()


def stalled_events(steps_until_s: float) -> list[tuple[str, str]]:
    """What homepd serve sends for a stream whose third token waited 300 ms on req-7's 256-token chunk, and a
    steps event covering the engine's steps up to ``steps_until_s``."""
    lc = Lifecycle("chatcmpl-1", arrived_s=100.0, n_prompt_tokens=9)
    lc.advance(RequestState.PREFILLING, 100.0)
    lc.advance(RequestState.DECODING, 100.25)
    steps = [StepRecord("colocated", 0, 100.25, 100.30, ("chatcmpl-1",), ()),
             StepRecord("colocated", 1, 100.30, 100.35, ("chatcmpl-1",), ()),
             StepRecord("colocated", 2, 100.35, 100.65, ("chatcmpl-1",), (("req-7", 256),)),
             StepRecord("colocated", 3, 100.65, 100.70, ("chatcmpl-1",), ())]
    for s in steps:
        lc.add_token(s.t_end_s)
    lc.advance(RequestState.FINISHED, 100.70)
    request = {**lc.to_dict(), "request_class": "interactive", **TokenGaps.of(lc.request_id, lc.token_times_s,
                                                                               100.0).to_dict()}
    return [("request", json.dumps(request)), ("steps", json.dumps(StepSample.of(steps, steps_until_s).to_dict()))]


def test_the_service_s_steps_give_the_attached_dashboard_its_stalls_itl_and_interference(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "EVENTS", stalled_events(steps_until_s=100.8))
    source = make()
    try:
        source.start(lambda message: None)
        assert source.wait_finished(["chatcmpl-1"], 10)
        tick = source.tick()
        (row,) = tick.requests
        assert row.itl_max_ms == pytest.approx(300.0) and row.stall == "300 ms ← req-7 (256 tok, same step)"
        assert tick.point.itl_ms == pytest.approx(300.0) and tick.point.interference == pytest.approx(6.0)
    finally:
        source.stop()


def test_a_finished_request_waits_for_the_steps_up_to_its_end(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "EVENTS", stalled_events(steps_until_s=100.6))  # ended at 100.7
    source = make()
    try:
        source.start(lambda message: None)
        assert source.wait_live(10)                   # the snapshot comes after the request and steps events
        tick = source.tick()
        assert tick.requests == () and tick.point.interference is not None   # the steps are in; the row waits
    finally:
        source.stop()


def test_events_the_service_could_not_keep_for_a_slow_app_are_shown_as_missed(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "EVENTS", [("missed", json.dumps({"events": 7})),
                                                          ("missed", json.dumps({"events": 5}))])
    source = make()
    try:
        source.start(lambda message: None)
        assert source.wait_live(10)  # the snapshot comes after the two notices
        assert "live, 12 events missed" in source.description
    finally:
        source.stop()


def test_a_chat_turn_streams_and_carries_the_service_timings():
    source = make()
    try:
        source.start(lambda message: None)
        pieces: list[Delta] = []
        stats = source.chat([{"role": "user", "content": "hi"}], pieces.append, max_tokens=8)
        assert pieces == [Delta(DeltaKind.CONTENT, "Hel"), Delta(DeltaKind.CONTENT, "lo")]
        assert "tools" not in CHAT_BODIES[-1]
        assert (CHAT_BODIES[-1]["temperature"], CHAT_BODIES[-1]["top_p"]) == (0.7, 0.9)  # as chat clients sample
        assert (stats.ttft_ms, round(stats.tpot_ms), stats.mode, stats.finish_reason) == \
            (pytest.approx(120.0), 50, "colocated", "stop")
        assert (stats.n_prompt_tokens, stats.n_output_tokens, stats.kv_bytes) == (9, 2, None)
        assert stats.n_cached_tokens == 6  # from the reply's homepd object
    finally:
        source.stop()


def test_a_reply_s_reasoning_content_and_tool_call_fragments_come_apart():
    source = make()
    try:
        source.start(lambda message: None)
        turn = ChatTurn("what time is it?")
        stats = source.chat([{"role": "user", "content": "what time is it?"}], turn.add, offer_tool=True)
        body = CHAT_BODIES[-1]
        assert [t["function"]["name"] for t in body["tools"]] == ["get_current_time"]
        assert body["tool_choice"] == "auto"
        assert body["tools"][0]["function"]["parameters"]["required"] == ["timezone"]
        assert (turn.reasoning, turn.reply) == ("The user wants the time.", "Checking.")
        assert turn.tool_calls == {0: ToolCall("call_abc", "get_current_time", '{"timezone":"UTC"}')}
        assert stats.finish_reason == "tool_calls"
    finally:
        source.stop()


def test_a_tool_call_fragment_starts_its_call_once_and_streams_its_arguments():
    started: set[int] = set()
    first = chunk_deltas({"tool_calls": [{"index": 1, "function": {"name": "f", "arguments": "{"}}]}, started)
    assert first == [Delta(DeltaKind.TOOL_CALL_START, index=1, id="call_1", name="f"),
                     Delta(DeltaKind.TOOL_CALL_ARGS, "{", index=1)]
    assert chunk_deltas({"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]}, started) == \
        [Delta(DeltaKind.TOOL_CALL_ARGS, "}", index=1)]
    with pytest.raises(RecordShapeError, match="no index"):
        chunk_deltas({"tool_calls": [{"function": {"name": "f"}}]}, started)


def test_a_renamed_snapshot_field_is_an_error_naming_it_not_a_dashboard_of_zeros(monkeypatch):
    monkeypatch.setitem(RENAME, "n_ctx", "context_tokens")
    source = make()
    try:
        source.start(lambda message: None)   # /status is not renamed: the connection comes up
        deadline = time.monotonic() + 10
        while "missing" not in source.description and time.monotonic() < deadline:  # the reader thread's verdict
            time.sleep(0.01)
        tick = source.tick()
        assert not source.wait_live(0)
        assert "missing field(s) n_ctx" in tick.status and "unknown field(s) context_tokens" in tick.status
        assert tick.architecture.n_ctx == 4096   # still the last snapshot that had the engine's shape
    finally:
        source.stop()


def test_a_wrong_key_is_an_error_that_says_so():
    source = make(api_key="wrong-key-999")
    with pytest.raises(HomepdError, match="missing or wrong API key"):
        source.start(lambda message: None)
    source.stop()


def test_the_service_address_comes_from_the_environment_or_the_config_file(tmp_path, monkeypatch):
    for name in ("HOMEPD_HOST", "HOMEPD_PORT", "HOMEPD_API_KEY", "HOMEPD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert service_address() == ("127.0.0.1", 8439, None)
    (tmp_path / "homepd").mkdir()
    (tmp_path / "homepd" / "config.toml").write_text('[serve]\nhost = "0.0.0.0"\nport = 9000\napi_key = "k"\n')
    assert service_address() == ("127.0.0.1", 9000, "k")   # listening everywhere: reached on loopback
    monkeypatch.setenv("HOMEPD_PORT", "9100")
    assert service_address()[1] == 9100


def test_no_service_answering_means_none_found():
    import socket

    with socket.socket() as s:       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert find_service(f"http://127.0.0.1:{port}") is False


def test_the_attached_app_reads_the_service_s_standing_advice(monkeypatch):
    from test_tui_live_advice import SWITCH

    source = make()
    assert source.advice() is None  # live advice off: 404
    monkeypatch.setitem(globals(), "ADVICE", SWITCH)
    view = source.advice()
    assert view.kind == "switch" and view.candidate == "disaggregated-routed" and view.running == "colocated-adaptive"
    assert len(view.evidence) == 2
    monkeypatch.setitem(globals(), "ADVICE", {**SWITCH, "kind": "keep", "candidate": "colocated-adaptive"})
    assert source.advice().kind == "keep"
    monkeypatch.setitem(globals(), "ADVICE", {"kind": "keep"})  # not what a service sends: named, not guessed
    with pytest.raises(RecordShapeError, match="advice: missing field"):
        source.advice()


def test_switching_from_the_attached_app_posts_to_the_service_and_names_its_refusal():
    source = make()
    assert source.apply_advice("disaggregated-routed") == ("disaggregated-routed: disaggregated: prefill + decode "
                                                           "(switched in 1.8 s)")
    with pytest.raises(HomepdError, match="no measured candidate 'replicas-9'"):
        source.apply_advice("replicas-9")
