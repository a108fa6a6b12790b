"""Whether a twin is trusted (homepd.twin.check): the measured count of requests within their SLO against the
twin's predictive band for that very trace, the probe's own noise counted."""
from __future__ import annotations

import math
from dataclasses import replace

from homepd.twin.check import ALPHA, band, chance, met_pmf, verdict
from homepd.twin.records import TwinCheck


def check(n: int, met: int, chances: tuple[float, ...] | None, n_draws: int = 16,
          predicted: float | None = None) -> TwinCheck:
    chances = chances if chances is not None else ()
    predicted = predicted if predicted is not None else (sum(chances) / n if chances else 1.0)
    return TwinCheck(0.5, 1000, n, met / n, 150.0, 3000.0, 90.0, predicted, 140.0, 2800.0, 85.0, mix="mixed",
                     predicted_chances=chances, n_draws=n_draws)


def test_the_pmf_of_equal_chances_is_the_binomial():
    pmf = met_pmf([0.8] * 10)
    assert math.isclose(sum(pmf), 1.0)
    for k, p in enumerate(pmf):
        assert math.isclose(p, math.comb(10, k) * 0.8 ** k * 0.2 ** (10 - k))


def test_the_band_leaves_at_most_alpha_outside():
    pmf = met_pmf([chance(0.9, 16)] * 20)
    low, high = band(pmf, ALPHA)
    assert sum(pmf[:low]) <= ALPHA / 2 and sum(pmf[high + 1:]) <= ALPHA / 2
    assert sum(pmf[:low + 1]) > ALPHA / 2        # one more count in would be past the tail


def test_two_misses_in_twelve_do_not_condemn_a_twin_that_saw_none():
    # 17 points off: over the old fixed bound of 15, within what 12 requests can show
    trusted, why, error = verdict((check(12, 10, (1.0,) * 12),))
    assert trusted and round(error) == 17 and "10 of 12 met" in why


def test_a_twin_far_from_the_measurement_is_not_trusted():
    trusted, why, _ = verdict((check(12, 7, (1.0,) * 12),))
    assert not trusted and why.startswith("not trusted")


def test_more_probes_narrow_the_band():
    one = check(12, 9, (0.97,) * 12)
    assert verdict((one,))[0]
    assert not verdict((one, one, one))[0]   # 27 of 36 where the twin expects ~34


def test_checks_stored_before_the_chances_are_judged_by_the_error():
    assert verdict((check(12, 10, None, predicted=0.9),))[0]          # 7 points
    assert not verdict((check(12, 9, None, predicted=1.0),))[0]       # 25 points, over 15


def test_a_twin_whose_box_drifted_since_its_burst_is_not_trusted_whatever_the_count():
    inside = check(12, 12, (1.0,) * 12)          # every request met, as the twin said
    assert verdict((inside,))[0]
    for speed in (0.70, 1.32):
        trusted, why, _ = verdict((replace(inside, step_speed=speed),))
        assert not trusted and f"{speed:.2f}x their calibrated time" in why and "12 of 12 met" in why
    trusted, why, _ = verdict((replace(inside, step_speed=1.05),))
    assert trusted and "calibrated time" not in why


def test_a_trusted_twin_whose_checks_ran_off_its_price_says_which_way_its_capacity_leans():
    inside = check(12, 12, (1.0,) * 12)          # at its capacity a short check meets all, whatever the twin's error
    for speed, way in ((0.77, "faster than its burst said (the capacity likely higher)"),
                       (1.18, "slower than its burst said (the capacity likely lower)")):
        trusted, why, _ = verdict((replace(inside, step_speed=speed),))
        assert trusted and why.startswith("checked") and f"{speed:.2f}x their calibrated time" in why and way in why


def test_draws_that_move_their_requests_together_widen_the_band_to_their_own_counts():
    # 16 requests, and 16 draws of which half met all 16 and half met 8: every request's chance is 3/4, and
    # independent chances put the count at 9-15; the draws themselves gave 8 and 16
    counts = (16,) * 8 + (8,) * 8
    chances = (0.75,) * 16
    together = replace(check(16, 16, chances), predicted_counts=counts)
    alone = check(16, 16, chances)
    assert not verdict((alone,))[0]           # all 16 met lies past the independent band
    assert verdict((together,))[0]            # a draw the twin itself gave
    assert not verdict((replace(together, measured_attainment=4 / 16),))[0]   # under every draw's count: refused


def test_pooled_checks_add_their_counts_up_so_one_far_off_check_is_not_hidden_by_the_others():
    # three checks as the twin saw them, and a fourth (27 requests) that met 20 where every draw met 3-8: the
    # draws' extremes added up (24 + 3 to 48 + 8) would hold the total of 56; the counts added up do not
    counts = (16,) * 8 + (8,) * 8
    usual = [replace(check(16, 12, (0.75,) * 16), predicted_counts=counts) for _ in range(3)]
    far = replace(check(27, 20, (0.2,) * 27), predicted_counts=(3, 4, 5, 5, 6, 6, 6, 7, 7, 7, 8, 8, 5, 4, 6, 7))
    total = sum(c.measured_met for c in (*usual, far))
    assert sum(min(c.predicted_counts) for c in (*usual, far)) <= total <= \
        sum(max(c.predicted_counts) for c in (*usual, far))
    assert verdict(tuple(usual))[0] and not verdict((*usual, far))[0]
