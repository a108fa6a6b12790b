"""What ``homepd serve`` streams of its step log on ``/events`` (the service's pure part, no engine): each client
holds a bounded sample of the steps whatever the step rate, and a finished request carries its token gaps."""
from __future__ import annotations

import types

import pytest

from homepd.config import EngineConfig
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.protocol import StepRecord
from homepd.core.terms import RequestClass
from homepd.measure.stepstream import MAX_STEPS, TokenGaps
from homepd.serve.service import Service
from homepd.serve.settings import ServeSettings


def service() -> Service:
    svc = Service(EngineConfig(backend="fake", itl_budget_ms=100.0), ServeSettings(record_traffic=False))
    svc.state = "ready"
    svc.engine = types.SimpleNamespace(health=lambda: types.SimpleNamespace(failed=(), restarting=False))
    return svc


def step(i: int) -> StepRecord:
    return StepRecord("colocated", i, i * 1e-3, i * 1e-3 + 5e-4, ("a",), (("p", 16),) if i % 10 == 0 else ())


def test_a_client_that_does_not_read_holds_only_its_bound_and_does_not_hold_the_others_back():
    svc = service()
    reading, stalled = svc.subscribe(), svc.subscribe()
    for i in range(10 * MAX_STEPS):       # a burst far over the bound, as the engine's listener sees it
        svc._on_step(step(i))
    sample = svc.drain_steps(reading)
    assert (len(sample.steps), sample.n_dropped, sample.n_decode_tokens) == (MAX_STEPS, 9 * MAX_STEPS, 10 * MAX_STEPS)
    assert sum(1 for s in sample.steps if s.prefill) == MAX_STEPS // 2   # prompt steps kept first, up to half
    svc._on_step(step(10 * MAX_STEPS + 1))
    assert svc.drain_steps(reading).n_steps == 1                          # the next interval, from empty
    late = svc.drain_steps(stalled)
    assert late.n_steps == 10 * MAX_STEPS + 1 and len(late.steps) == MAX_STEPS
    svc.unsubscribe(stalled)
    svc._on_step(step(0))                                                 # a client gone costs nothing more
    assert list(svc._subscribers) == [reading]


def test_a_finished_request_s_event_carries_its_largest_gap_and_its_gaps_over_the_itl_budget():
    svc = service()
    queue = svc.subscribe()
    svc.admit("r", RequestClass.INTERACTIVE)
    lc = Lifecycle("r", 10.0, n_prompt_tokens=3)
    lc.advance(RequestState.PREFILLING, 10.0)
    lc.advance(RequestState.DECODING, 10.1)
    for t in (10.1, 10.15, 10.45, 10.5):
        lc.add_token(t)
    lc.advance(RequestState.FINISHED, 10.5)
    svc.finished("r", lc, RequestClass.INTERACTIVE)
    kind, record = queue.get_nowait()
    gaps = TokenGaps.from_dict("r", record)
    assert kind == "request" and gaps.itl_max_ms == pytest.approx(300.0) and gaps.n_over == 1
    assert [(g.token_index, round(g.gap_ms)) for g in gaps.over_target] == [(2, 300)]


def test_a_client_that_reads_too_slowly_is_told_how_many_events_it_missed_before_its_next_one():
    from homepd.serve.service import SUBSCRIBER_QUEUE

    svc = service()
    slow, other = svc.subscribe(), svc.subscribe()
    for i in range(SUBSCRIBER_QUEUE + 5):
        svc.publish("request", {"n": i})
    assert slow.qsize() == SUBSCRIBER_QUEUE and svc.n_events_missed == 2 * 5  # both full: five each missed
    for _ in range(SUBSCRIBER_QUEUE):  # the slow client catches up; the other never reads again
        slow.get_nowait()
    svc.publish("request", {"n": "after"})
    assert [slow.get_nowait() for _ in range(2)] == [("missed", {"events": 5}), ("request", {"n": "after"})]
    assert svc.n_events_missed == 2 * 5 + 1  # the other client missed this one too, and will be told
    for j in range(3):
        svc.publish("request", {"n": j})
    assert [slow.get_nowait()[0] for _ in range(slow.qsize())] == ["request"] * 3  # told once, not again


def test_the_live_profile_counts_each_request_as_it_asks_including_one_refused_for_a_full_queue():
    from homepd.serve.errors import APIError

    svc = Service(EngineConfig(backend="fake", n_seq_max=1), ServeSettings(record_traffic=False, max_queue=1))
    svc.state = "ready"
    svc.engine = types.SimpleNamespace(health=lambda: types.SimpleNamespace(failed=(), restarting=False))
    svc.admit("a", RequestClass.INTERACTIVE)
    svc.admit("b", RequestClass.BACKGROUND)
    with pytest.raises(APIError):  # one sequence and one place in the queue: the third is refused
        svc.admit("c", RequestClass.INTERACTIVE)
    window = svc.advisor.profile.window(svc.advisor.settings.window_s, svc.advisor.clock())
    assert window.n_requests == 0  # none has ended
    assert window.rate_by_class == {"interactive": pytest.approx(2 / window.span_s),
                                    "background": pytest.approx(1 / window.span_s)}


def test_the_step_log_appends_every_step_of_each_model_s_engine_as_a_json_line(tmp_path, caplog):
    import json
    import time

    from homepd.errors import ConfigError
    from homepd.measure.steplog import StepLog

    path = tmp_path / "steps.jsonl"
    path.write_text('{"earlier": "run"}\n')          # appended to, never truncated
    svc = Service(EngineConfig(backend="fake", itl_budget_ms=100.0),
                  ServeSettings(record_traffic=False, step_log=str(path)))
    setup = types.SimpleNamespace(model_path="voice.gguf", model_fingerprint="f")   # what launch.prepare gives
    engine = svc.new_engine(EngineConfig(backend="fake", model="voice"), setup)
    granted = StepRecord("colocated", 7, time.monotonic() - 0.05, time.monotonic(), ("a", "b"), (("p", 12),),
                         budget=12, kv_in_use=768, granted_to="p", store_ms=1.5, n_waiting_for_id=1)
    for listener in engine.step_listeners:   # what the engine calls as each step ends
        listener(granted)
    lines = path.read_text().splitlines()     # line-buffered: in the file once the step has ended
    assert len(lines) == 2 and svc.step_log.n_written == 1
    row = json.loads(lines[1])
    assert row["model"] == "voice" and row["worker"] == "colocated" and row["index"] == 7
    assert (row["n_prompt_tokens"], row["n_decode_tokens"], row["kv_in_use"], row["budget"]) == (12, 2, 768, 12)
    assert row["granted_to"] == "p" and row["decode"] == ["a", "b"] and row["prefill"] == [["p", 12]]
    assert row["duration_ms"] == pytest.approx(50.0, abs=5.0) and abs(row["t_start_s"] - time.time()) < 5.0

    svc.step_log._file.close()                # a write that fails stops the log, not the service
    svc.step_log.write("voice", granted)
    assert svc.step_log.n_written == 1 and "stopped after 1 steps" in caplog.text
    svc.step_log.write("voice", granted)      # and is not tried again

    with pytest.raises(ConfigError, match="--step-log"):
        StepLog(str(tmp_path))                # a directory
    for bad in (str(tmp_path / "no-such-dir" / "steps.jsonl"), str(tmp_path), ""):
        with pytest.raises(ConfigError, match="--step-log"):
            ServeSettings(step_log=bad).validated()
