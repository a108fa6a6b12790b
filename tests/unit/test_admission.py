"""Admission and routing policies on constructed queues and measurements (pure)."""
import pytest

from homepd.core.admission import QueueState, RouteState, Verdict, admit, predict_ttft_ms, route
from homepd.core.terms import ClassBudget, RequestClass

I, B = RequestClass.INTERACTIVE, RequestClass.BACKGROUND
BUDGETS = {I: ClassBudget(ttft_ms=2000.0, itl_ms=100.0), B: ClassBudget(ttft_ms=30_000.0, itl_ms=None)}


def test_background_prompts_are_not_ahead_of_an_interactive_request():
    q = QueueState(queued_interactive_tokens=100, queued_background_tokens=4000, prefill_tok_s=200.0)
    assert predict_ttft_ms(I, 100, q) == pytest.approx(1000.0)
    assert predict_ttft_ms(B, 100, q) == pytest.approx(21_000.0)
    assert admit(I, 100, q, BUDGETS).verdict is Verdict.ADMIT


def test_a_request_that_would_miss_its_budget_is_rejected_early_with_retry_after():
    q = QueueState(queued_interactive_tokens=600, queued_background_tokens=0, prefill_tok_s=200.0)
    d = admit(I, 100, q, BUDGETS)
    assert d.verdict is Verdict.REJECT and d.predicted_ttft_ms == pytest.approx(3500.0)
    assert d.retry_after_s == pytest.approx(1.5) and "exceeds the interactive budget 2000 ms" in d.reason


def test_background_waits_behind_queued_interactive_work_and_is_admitted_when_none_is_queued():
    busy = QueueState(queued_interactive_tokens=50, queued_background_tokens=0, prefill_tok_s=200.0)
    assert admit(B, 1000, busy, BUDGETS).verdict is Verdict.DEFER
    idle = QueueState(queued_interactive_tokens=0, queued_background_tokens=1000, prefill_tok_s=200.0)
    assert admit(B, 1000, idle, BUDGETS).verdict is Verdict.ADMIT
    flooded = QueueState(queued_interactive_tokens=0, queued_background_tokens=10_000, prefill_tok_s=200.0)
    assert admit(B, 1000, flooded, BUDGETS).verdict is Verdict.REJECT


def test_routing_threshold_follows_the_measurements():
    base = dict(prefill_tok_s_prefill=200.0, prefill_tok_s_decode=180.0, handoff_ms_per_token=0.02,
                handoff_base_ms=2.0, max_local_tokens=64)
    idle = RouteState(prefill_queue_tokens=0, **base)
    busy = RouteState(prefill_queue_tokens=2000, **base)
    assert not route(40, idle).on_decode_worker            # the prefill worker is free and as fast
    assert route(40, busy).on_decode_worker                # a long document is queued there
    assert not route(500, busy).on_decode_worker           # too long for the decode worker's ITL budget
    assert route(40, busy).threshold_tokens == 64 and route(40, idle).threshold_tokens < 40


def test_an_unknown_request_class_is_refused_naming_the_classes():
    assert RequestClass.parse(None) is I and RequestClass.parse("background") is B
    with pytest.raises(ValueError, match="interactive, background"):
        RequestClass.parse("urgent")
