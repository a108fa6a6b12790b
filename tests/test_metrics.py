from __future__ import annotations

from homepd.messages import StepRecord
from homepd.metrics import interference, percentile


def test_percentile_is_nearest_rank():
    assert percentile([1, 2], 50) == 1
    assert percentile(list(range(1, 11)), 50) == 5
    assert percentile(list(range(1, 21)), 95) == 19
    assert percentile(list(range(1, 21)), 100) == 20
    assert percentile([7], 95) == 7 and percentile([], 50) is None


def test_interference_compares_decode_steps_with_and_without_prompt_tokens():
    def step(i, ms, n_dec, n_prompt):
        return StepRecord("colocated", i, 0.0, ms / 1e3, tuple(f"d{j}" for j in range(n_dec)),
                          (("p", n_prompt),) if n_prompt else ())
    steps = [step(0, 10, 2, 0), step(1, 12, 2, 0), step(2, 50, 2, 64), step(3, 100, 0, 128)]
    inter = interference(steps)
    assert inter.decode_only_ms == 11 and inter.mixed_ms == 50
    assert inter.slowdown == 50 / 11 and inter.mixed_prompt_tokens == 64
