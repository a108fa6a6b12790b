"""The dashboard's step window (``homepd.tui.stepwindow``), shared by the embedded and the remote source."""
from __future__ import annotations

import json

import pytest

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.protocol import StepRecord
from homepd.measure.stepstream import StepSample, TokenGaps
from homepd.tui.stepwindow import StepWindow

T0 = 5000.0   # the engine's clock; the app's is another


def stalled_stream():
    """Request a decodes alone, then p's 256-token chunk shares (and slows) one of its steps: a 230 ms gap."""
    lc = Lifecycle("a", T0, n_prompt_tokens=4)
    lc.advance(RequestState.PREFILLING, T0)
    lc.advance(RequestState.DECODING, T0 + 0.01)
    steps = [StepRecord("colocated", i, T0 + 0.01 * i, T0 + 0.01 * (i + 1), ("a",), ()) for i in range(1, 6)]
    steps.append(StepRecord("colocated", 6, T0 + 0.06, T0 + 0.29, ("a",), (("p", 256),)))
    steps += [StepRecord("colocated", i, T0 + 0.29 + 0.01 * (i - 7), T0 + 0.30 + 0.01 * (i - 7), ("a", "p"), ())
              for i in range(7, 10)]
    for s in steps:
        lc.add_token(s.t_end_s)
    lc.advance(RequestState.FINISHED, steps[-1].t_end_s)
    return lc, steps


def test_a_stall_is_shown_with_the_prompt_that_held_it_and_the_window_gives_the_interference():
    lc, steps = stalled_stream()
    window = StepWindow()
    gaps = TokenGaps.of("a", lc.token_times_s, itl_target_ms=100.0)
    (row,), point = window.tick(1.0, 0.5, [(lc.timings(), gaps)], [StepSample.of(steps, T0 + 0.4)])
    assert row.itl_max_ms == pytest.approx(230.0) and row.stall == "230 ms ← p (256 tok, same step)"
    assert point.itl_ms == pytest.approx(230.0) and point.tok_s == pytest.approx(24.0)   # 12 decode tokens in 0.5 s
    assert point.interference == pytest.approx(23.0)          # the mixed step against the lone ones of 1 decode


def test_what_came_through_the_events_json_draws_what_the_engine_s_own_records_draw():
    lc, steps = stalled_stream()
    gaps, sample = TokenGaps.of("a", lc.token_times_s, 100.0), StepSample.of(steps, T0 + 0.4)
    embedded = StepWindow().tick(1.0, 0.5, [(lc.timings(), gaps)], [sample])
    wire_gaps = TokenGaps.from_dict("a", json.loads(json.dumps(gaps.to_dict())))
    wire_sample = StepSample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert StepWindow().tick(1.0, 0.5, [(lc.timings(), wire_gaps)], [wire_sample]) == embedded


def test_the_window_keeps_a_minute_on_the_engine_s_clock_whatever_the_app_s_clock_says():
    lc, steps = stalled_stream()
    window = StepWindow(window_s=60.0)
    window.tick(1e6, 0.5, [], [StepSample.of(steps, T0 + 0.4)])
    assert len(window.steps) == len(steps)                     # the app's clock (1e6) prunes nothing
    later = [StepRecord("colocated", 99, T0 + 61.0, T0 + 61.01, ("b",), ())]
    window.tick(1e6 + 61, 0.5, [], [StepSample.of(later, T0 + 61.0)])
    assert list(window.steps) == later


def test_without_a_step_stream_rows_have_no_stall_and_the_charts_no_interference():
    lc, _ = stalled_stream()
    (row,), point = StepWindow().tick(1.0, 0.5, [(lc.timings(), TokenGaps.of("a", lc.token_times_s, 100.0))], [])
    assert row.itl_max_ms == pytest.approx(230.0) and row.stall == ""
    assert point.interference is None and point.itl_ms is None and point.tok_s == pytest.approx(18.0)
