"""Live advice (``homepd.advise.live.advice``) on constructed profiles and evidence: it flips when the traffic crosses
into a mix where another candidate measured better, not on noise within the spread nor within the hysteresis
window, says "unmeasured" outside the evidence and warns at capacity."""
from __future__ import annotations

import pytest

from homepd.advise.live.advice import (AdviceKind, AdviceTracker, EvidenceRow, LiveEvidence, LiveSettings, MixShape,
                                judge)
from homepd.core.terms import RequestClass
from homepd.measure.profile import FinishedRequest, TrafficProfile

CO, DI = "colocated-adaptive", "disaggregated-routed"
SHAPES = {"short": MixShape("short", 40, 0.0, 0.0, 30, 45, 32),
          "long": MixShape("long", 40, 1.0, 1.0, 420, 440, 32),
          "mixed": MixShape("mixed", 40, 0.25, 0.25, 35, 430, 32)}


def evidence(long_di=3.0, long_di_spread=0.5, short_co_spread=1.0) -> LiveEvidence:
    rows = (EvidenceRow(7, CO, "short", 8.0, short_co_spread, 11.3), EvidenceRow(7, DI, "short", 4.0, 1.6, 5.7),
            EvidenceRow(7, CO, "long", 1.0, 0.4, 2.0), EvidenceRow(7, DI, "long", long_di, long_di_spread, 4.0),
            EvidenceRow(7, CO, "mixed", 2.0, 0.8, 2.8), EvidenceRow(7, DI, "mixed", 2.2, 0.6, 2.8))
    return LiveEvidence(7, "m", rows, SHAPES, {CO: {"mode": "colocated"}, DI: {"mode": "disaggregated"}})


def window(n, t0, span_s, n_prompt, klass=RequestClass.INTERACTIVE, n_output=32, window_s=60.0):
    """``n`` requests over the last ``span_s`` of a window ending at t0 + span_s (clear of its oldest bucket,
    which the window counts whole or not at all)."""
    p = TrafficProfile((window_s,), since_unix_s=0.0)
    bucket_s = window_s / 30
    for k in range(n):
        p.observe(FinishedRequest(t0 + bucket_s + (span_s - bucket_s) * (k + 1) / n, klass, n_prompt, n_output, 0, True))
    return p.window(window_s, now_unix_s=t0 + span_s)


def chats(rate=0.5):
    return window(round(rate * 60), 1000.0, 60.0, 30)


def documents(rate=0.5, n_prompt=420):
    return window(round(rate * 60), 1000.0, 60.0, n_prompt, RequestClass.BACKGROUND)


def test_short_chats_keep_colocated_and_long_documents_advise_disaggregation_with_evidence():
    keep = judge(chats(), evidence(), CO)
    assert keep.kind is AdviceKind.KEEP and keep.mix == "short" and keep.candidate == CO
    switch = judge(documents(), evidence(), CO)
    assert switch.kind is AdviceKind.SWITCH and switch.mix == "long" and switch.candidate == DI
    assert switch.margin_rps == pytest.approx(2.0)
    assert [(r.run_id, r.candidate, r.mix, r.capacity_rps) for r in switch.evidence] == [(7, DI, "long", 3.0),
                                                                                         (7, CO, "long", 1.0)]
    assert switch.live.rate_rps == pytest.approx(0.5) and switch.confidence in ("high", "medium")
    assert {h.candidate: h.headroom for h in switch.headroom} == {DI: pytest.approx(6.0), CO: pytest.approx(2.0)}
    assert "run 7" in switch.reason and "long" in switch.reason


def test_no_flip_when_the_better_capacity_lies_within_the_running_ones_spread():
    tied = judge(documents(), evidence(long_di=1.3), CO)     # 1.3 <= 1.0 + 0.4
    assert tied.kind is AdviceKind.KEEP and "within the spread" in tied.reason
    assert judge(documents(), evidence(long_di=1.5), CO).kind is AdviceKind.SWITCH


def test_the_hysteresis_holds_a_flip_until_it_has_lasted_and_forgets_a_blip():
    tracker = AdviceTracker(CO, hysteresis_s=30.0)
    ev = evidence()
    assert tracker.update(judge(documents(), ev, CO), 100.0) is None      # the shift starts
    assert tracker.update(judge(chats(), ev, CO), 110.0) is None          # a blip back: forgotten
    assert tracker.update(judge(documents(), ev, CO), 120.0) is None
    assert tracker.update(judge(documents(), ev, CO), 149.0) is None      # 29 s: not yet
    event = tracker.update(judge(documents(), ev, CO), 150.0)
    assert event is not None and event.verdict.kind is AdviceKind.SWITCH and event.verdict.candidate == DI
    assert event.held_since_unix_s == 120.0 and event.seq == 1
    assert tracker.update(judge(documents(), ev, CO), 200.0) is None      # raised once
    quiet = judge(window(3, 1000.0, 60.0, 420, RequestClass.BACKGROUND), ev, CO)
    assert quiet.kind is AdviceKind.QUIET and tracker.update(quiet, 300.0) is None
    assert [e.seq for e in tracker.history] == [1]


def test_traffic_unlike_any_measured_mix_is_unmeasured_and_offers_to_measure_it():
    longer = judge(documents(n_prompt=4000), evidence(), CO)
    assert longer.kind is AdviceKind.UNMEASURED and "longer than any measured" in longer.reason
    assert longer.offer == "homepd advise --traffic service:1m"
    odd = judge(window(30, 1000.0, 60.0, 420, RequestClass.INTERACTIVE, n_output=900), evidence(), CO)
    assert odd.kind is AdviceKind.UNMEASURED and "no measured mix is like it" in odd.reason
    unknown = judge(chats(), evidence(), "replicas-2")
    assert unknown.kind is AdviceKind.UNMEASURED and "was not measured" in unknown.reason


def test_a_rate_above_everything_probed_with_no_failure_is_unmeasured():
    fast = judge(chats(rate=12.0), evidence(short_co_spread=None), CO)
    assert fast.kind is AdviceKind.UNMEASURED and "above every rate" in fast.reason


def test_at_capacity_when_the_running_one_cannot_hold_the_rate_and_nothing_is_better():
    hot = judge(chats(rate=9.0), evidence(), CO)              # CO holds 8 +- 1 on short, DI 4
    assert hot.kind is AdviceKind.AT_CAPACITY and hot.candidate == CO and hot.confidence == "high"
    assert hot.margin_rps == pytest.approx(-1.0) and "at capacity" in hot.reason
    warm = judge(chats(rate=8.5), evidence(), CO)
    assert warm.kind is AdviceKind.AT_CAPACITY and warm.confidence == "medium"


def test_no_evidence_and_too_little_traffic_are_said_as_such():
    assert judge(chats(), None, CO).kind is AdviceKind.NO_EVIDENCE
    assert judge(chats(), evidence(), CO, LiveSettings(min_requests=100)).kind is AdviceKind.QUIET


def test_the_services_advice_options_read_durations_and_refuse_what_cannot_work():
    from homepd.errors import ConfigError
    from homepd.serve.settings import ServeSettings, parse_durations, parse_seconds

    assert parse_durations("5m,1h, 24h") == (300.0, 3600.0, 86_400.0) and parse_seconds("0") == 0.0
    with pytest.raises(ValueError, match="give seconds or a duration"):
        parse_seconds("soon")
    for bad, what in ((dict(advice_windows_s=()), "advice_windows_s"), (dict(advice_period_s=0.0), "advice_period_s"),
                      (dict(auto_apply_interval_s=0.0), "--auto-apply needs a minimum interval")):
        with pytest.raises(ConfigError, match=what):
            ServeSettings(**bad).validated()


def test_evidence_measured_on_another_box_gives_no_advice_and_says_so():
    from dataclasses import replace

    foreign = replace(evidence(), rows=(), foreign="the advise runs of this model were measured on another box")
    verdict = judge(documents(), foreign, CO)
    assert verdict.kind is AdviceKind.NO_EVIDENCE and verdict.offer == "homepd advise"
    assert "another box" in verdict.reason
