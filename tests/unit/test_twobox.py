"""Two boxes on paper: the projected KV handoff over Ethernet, from constructed bytes and bandwidths."""
from __future__ import annotations

import pytest

from homepd.advise.report.twobox import (PAYLOAD_EFFICIENCY, PER_HANDOFF_LATENCY_S, HandoffSample, kv_bytes_per_token,
                                  project, render_projection, wire_s)

MB = 1_000_000


def test_wire_time_is_bytes_over_the_payload_rate_plus_one_latency():
    # 1 MB over 1 Gbit/s: 8e6 bit / (1e9 * 0.9415) = 8.50 ms, plus the per-handoff latency
    assert wire_s(MB, 1.0) == pytest.approx(8e6 / (1e9 * PAYLOAD_EFFICIENCY) + PER_HANDOFF_LATENCY_S)
    assert wire_s(MB, 1.0) * 1e3 == pytest.approx(9.497, abs=0.01)
    # ten times the link, a tenth of the wire time (the latency stays)
    assert wire_s(MB, 10.0) - PER_HANDOFF_LATENCY_S == pytest.approx((wire_s(MB, 1.0) - PER_HANDOFF_LATENCY_S) / 10)
    assert wire_s(0, 2.5) == PER_HANDOFF_LATENCY_S
    with pytest.raises(ValueError, match="link speed"):
        wire_s(MB, 0)


def test_kv_bytes_per_token_is_the_median_over_handed_off_prompts_only():
    samples = [HandoffSample(100, 100 * 30_000, 0.5), HandoffSample(200, 200 * 31_000, 0.6),
               HandoffSample(50, 50 * 90_000, 0.4),        # one odd extent: the median ignores it
               HandoffSample(20, None, 0.1)]                # prefilled on the decode worker: no ratio
    assert kv_bytes_per_token(samples) == 31_000
    assert kv_bytes_per_token([HandoffSample(20, None, 0.1)]) is None


def test_a_slow_link_misses_the_ttft_budget_that_a_fast_one_keeps():
    # 1000-token prompts at 100 kB/token: 100 MB each. 1 Gbit/s: 851 ms a handoff; 10 Gbit/s: 86 ms.
    # measured TTFT 3.5 s against a 4 s budget: only the fast link keeps it
    samples = [HandoffSample(1000, 100_000 * 1000, 3.5) for _ in range(10)]
    p = project("disaggregated", "long", samples, ttft_budget_ms=4000.0, links_gbit_s=(1.0, 10.0))
    slow, fast = p.links
    assert slow.handoff_ms_p50 == pytest.approx(wire_s(100 * MB, 1.0) * 1e3)
    assert slow.ttft_ms_p99 == pytest.approx(3500 + slow.handoff_ms_p50)
    assert (slow.ttft_attainment, slow.keeps_ttft_budget) == (0.0, False)
    assert (fast.ttft_attainment, fast.keeps_ttft_budget) == (1.0, True)
    assert p.kv_bytes_per_token == 100_000 and p.note == "projected, not measured"


def test_the_verdict_uses_the_target_share_and_counts_a_request_without_first_token_as_missed():
    # 9 fast requests, 1 that never got a first token: attainment 90 %, which keeps a 90 % target, not a 95 % one
    samples = [HandoffSample(100, 100 * 1000, 0.2) for _ in range(9)] + [HandoffSample(100, 100 * 1000, None)]
    keeps = project("d", "mixed", samples, ttft_budget_ms=4000.0, target_share=0.9, links_gbit_s=(1.0,))
    misses = project("d", "mixed", samples, ttft_budget_ms=4000.0, target_share=0.95, links_gbit_s=(1.0,))
    assert keeps.links[0].ttft_attainment == pytest.approx(0.9) and keeps.links[0].keeps_ttft_budget
    assert misses.links[0].keeps_ttft_budget is False


def test_background_requests_do_not_count_against_the_interactive_budget():
    samples = [HandoffSample(100, 100 * 1000, 0.2), HandoffSample(4000, 4000 * 1000, 60.0, is_interactive=False)]
    p = project("d", "mixed", samples, ttft_budget_ms=4000.0, links_gbit_s=(1.0,))
    assert p.links[0].ttft_attainment == 1.0
    assert p.links[0].handoff_ms_max == pytest.approx(wire_s(4000 * 1000, 1.0) * 1e3)  # every prompt crosses


def test_runs_that_moved_no_kv_give_a_reason_not_a_row():
    p = project("disaggregated", "long", [HandoffSample(300, None, 1.0)], ttft_budget_ms=4000.0)
    assert p.links == () and "no KV was handed off" in p.reason
    text = render_projection([p])
    assert "projected, not measured" in text and "no KV was handed off" in text


def test_the_table_names_every_link_and_the_verdict():
    samples = [HandoffSample(1000, 100_000 * 1000, 3.5)]
    text = render_projection([project("disaggregated", "long", samples, ttft_budget_ms=4000.0,
                                      measured_handoff_ms=[4.0])])
    assert "projected, not measured" in text
    for link in ("1 Gb/s", "2.5 Gb/s", "10 Gb/s"):
        assert link in text
    assert "misses the 4000 ms TTFT budget" in text and "keeps the 4000 ms TTFT budget" in text
    assert "handoff p50 4.0 ms" in text and "measured" in text
    assert render_projection([]) == ""


def test_a_mix_without_interactive_requests_is_not_judged():
    samples = [HandoffSample(4000, 4000 * 1000, 60.0, is_interactive=False)]
    p = project("d", "long", samples, ttft_budget_ms=4000.0, links_gbit_s=(1.0,))
    assert (p.links[0].ttft_attainment, p.links[0].keeps_ttft_budget, p.links[0].ttft_ms_p99) == (None, None, None)
    assert "no interactive request to judge" in render_projection([p])
