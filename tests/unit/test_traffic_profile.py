"""The live traffic profile (``homepd.measure.profile``): rates per class, token quantiles, shares and SLO
attainment over rolling windows, bounded memory, on constructed requests."""
from __future__ import annotations

import pytest

from homepd.core.terms import RequestClass
from homepd.measure.profile import N_TOKEN_BINS, FinishedRequest, TrafficProfile, bin_value, token_bin

I, B = RequestClass.INTERACTIVE, RequestClass.BACKGROUND


def req(t, klass=I, n_prompt=40, n_output=20, n_cached=0, met=True):
    return FinishedRequest(t, klass, n_prompt, n_output, n_cached, met)


def test_a_window_holds_rate_per_class_shares_ratio_and_attainment():
    p = TrafficProfile((60.0, 600.0), since_unix_s=0.0)
    for k in range(30):                       # 30 chats over the last minute, 10 of them missed
        p.observe(req(542 + 2 * k, n_prompt=40, n_output=20, n_cached=10, met=k % 3 != 0))
    for k in range(6):                        # 6 documents, 2 minutes earlier
        p.observe(req(400 + k, B, n_prompt=600, n_output=100))
    w = p.window(60.0, now_unix_s=600.0)
    assert w.n_requests == 30 and w.rate_rps == pytest.approx(0.5)
    assert w.rate_by_class == {"interactive": pytest.approx(0.5)}
    assert w.long_share == 0 and w.background_share == 0
    assert w.prefix_hit_share == pytest.approx(0.25)
    assert w.prefill_decode_ratio == pytest.approx(30 * 30 / (30 * 20))
    assert w.slo_attainment == {"interactive": pytest.approx(20 / 30)}
    ten = p.window(600.0, now_unix_s=600.0)   # the longer window sees both
    assert ten.n_requests == 36 and ten.rate_by_class["background"] == pytest.approx(6 / 600)
    assert ten.long_share == pytest.approx(6 / 36) and ten.background_share == pytest.approx(6 / 36)
    assert ten.prompt_tokens["p50"] == pytest.approx(40, rel=0.1)
    assert ten.prompt_tokens["p99"] == pytest.approx(600, rel=0.1)


def test_requests_leave_the_window_as_time_passes_and_memory_stays_bounded():
    p = TrafficProfile((10.0,), since_unix_s=0.0, n_buckets=10)
    for t in range(1000):
        p.observe(req(float(t)))
    assert p.window(10.0, now_unix_s=999.5).n_requests == 10
    assert p.window(10.0, now_unix_s=2000.0).n_requests == 0
    assert len(p._rings[10.0].buckets) <= 11


def test_a_young_profile_judges_its_rate_over_the_time_it_has_seen():
    p = TrafficProfile((300.0,), since_unix_s=1000.0)
    for k in range(10):
        p.observe(req(1000.0 + k))
    w = p.window(300.0, now_unix_s=1020.0)
    assert w.span_s == pytest.approx(20.0) and w.rate_rps == pytest.approx(0.5)


def test_unjudged_requests_count_in_the_rates_but_not_in_the_attainment():
    p = TrafficProfile((60.0,), since_unix_s=0.0)
    p.observe(req(10.0, met=None))
    p.observe(req(11.0, met=False))
    w = p.window(60.0, now_unix_s=30.0)
    assert w.n_requests == 2 and w.slo_attainment == {"interactive": 0.0}


def test_the_rate_counts_requests_as_they_arrive_so_a_backlog_shows_before_it_ends():
    p = TrafficProfile((60.0,), since_unix_s=0.0)
    for k in range(30):                       # 30 chats asked for over the last minute; 10 have ended so far
        p.arrive(542.0 + 2 * k, I)
        if k < 10:
            p.observe(req(542.0 + 2 * k))
    w = p.window(60.0, now_unix_s=600.0)
    assert w.rate_rps == pytest.approx(0.5) and w.n_requests == 10   # told twice, counted once
    assert w.rate_by_class == {"interactive": pytest.approx(0.5)}
    # a profile rebuilt from the store knows only requests that ended: each counts in its arrival bucket
    rebuilt = TrafficProfile((60.0,), since_unix_s=0.0)
    for k in range(10):
        rebuilt.observe(req(542.0 + 2 * k))
    rebuilt.arrive(590.0, B)                  # then the live service tells arrivals again
    assert rebuilt.window(60.0, now_unix_s=600.0).rate_by_class == {"interactive": pytest.approx(10 / 60),
                                                                      "background": pytest.approx(1 / 60)}


def test_token_bins_are_within_a_quarter_octave():
    for n in (1, 7, 40, 531, 9999):
        assert abs(bin_value(token_bin(n)) / n - 1) < 0.1
    assert token_bin(0) == 0 and token_bin(10 ** 9) == N_TOKEN_BINS - 1
