from __future__ import annotations

import pytest

from homepd.core.protocol import StepRecord
from homepd.measure.metrics import interference, percentile


def test_percentile_is_nearest_rank():
    assert percentile([1, 2], 50) == 1
    assert percentile(list(range(1, 11)), 50) == 5
    assert percentile(list(range(1, 21)), 95) == 19
    assert percentile(list(range(1, 21)), 100) == 20
    assert percentile([7], 95) == 7 and percentile([], 50) is None


def step(role, t0_ms, ms, n_dec, n_prompt):
    return StepRecord(role, 0, t0_ms / 1e3, (t0_ms + ms) / 1e3, tuple(f"d{j}" for j in range(n_dec)),
                      (("p", n_prompt),) if n_prompt else ())


def test_colocated_interference_compares_decode_steps_with_and_without_prompt_tokens():
    steps = [step("colocated", 0, 10, 2, 0), step("colocated", 10, 12, 2, 0), step("colocated", 22, 50, 2, 64),
             step("colocated", 72, 100, 0, 128)]
    inter = interference(steps)
    assert inter.decode_only_ms == pytest.approx(11) and inter.mixed_ms == pytest.approx(50)
    assert inter.slowdown == pytest.approx(50 / 11) and inter.mixed_prompt_tokens == 64


def test_interference_is_matched_on_decode_batch_size():
    # bigger batches are slower anyway: that must not count as interference
    steps = [step("colocated", 0, 10, 1, 0), step("colocated", 10, 20, 4, 0),
             step("colocated", 30, 11, 1, 8), step("colocated", 41, 22, 4, 8)]
    assert interference(steps).slowdown == pytest.approx((11 / 10 + 22 / 20) / 2)


def test_disaggregated_interference_uses_concurrent_prefill_steps():
    steps = [step("prefill", 100, 50, 0, 64),                       # prefill busy 100..150 ms
             step("decode", 0, 10, 2, 0), step("decode", 10, 10, 2, 0),   # alone
             step("decode", 95, 15, 2, 0), step("decode", 140, 15, 2, 0),  # mostly beside the prefill step
             step("decode", 148, 10, 2, 0),                          # 2 of 10 ms beside it: alone
             step("decode", 160, 10, 2, 0)]                          # alone again
    inter = interference(steps)
    assert inter.decode_only_steps == 4 and inter.mixed_steps == 2
    assert inter.slowdown == pytest.approx(1.5) and inter.mixed_prompt_tokens == 64
