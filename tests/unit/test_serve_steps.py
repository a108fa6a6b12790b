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
