"""A KV store save's cost (homepd.kv.savecost), as the worker fits it and the twin adds it between two steps."""
from __future__ import annotations

import random

from homepd.kv.savecost import SaveCost
from homepd.twin.calibration import Reuse
from homepd.twin.sim import _Store


def test_a_saves_fixed_part_is_fitted_apart_from_its_cost_per_token():
    """Saves as this box gave them (~80-token prefixes 5-33 ms, ~450-token documents 16-72 ms): a document's save is
    priced near what it took, not at the mean per token (which priced it at ~3x a prefix's)."""
    rng = random.Random(1)
    cost = SaveCost()
    for _ in range(40):
        cost.add(80, 11.0 + 0.035 * 80 + rng.uniform(-5, 5))
        if rng.random() < 0.3:
            cost.add(450, 11.0 + 0.035 * 450 + rng.uniform(-8, 8))
    base, per_token = cost.fit()
    assert 7.0 < base < 15.0 and 0.015 < per_token < 0.06
    assert abs(base + per_token * 450 - 26.75) < 6.0          # a document: ~27 ms, as measured
    assert cost.fit() == (base, per_token)


def test_one_size_of_save_is_priced_per_token_and_nothing_is_negative():
    cost = SaveCost()
    assert cost.fit() is None
    cost.add(100, 20.0)
    cost.add(100, 30.0)
    assert cost.fit() == (0.0, 0.25)
    falling = SaveCost()   # bigger saves took less: no cost per token, the mean as the fixed part
    falling.add(100, 30.0)
    falling.add(400, 10.0)
    assert falling.fit() == (20.0, 0.0)


def test_the_twins_store_adds_a_saves_fixed_part_and_its_tokens():
    reuse = Reuse(mode="prefix", store_capacity_bytes=1 << 30, save_ms_per_token=0.035, restore_ms_per_token=0.05,
                  save_base_ms=11.0)
    store = _Store(reuse, 0, lambda: None)
    store.save(0, tuple(range(450)))
    assert abs(store.busy_ms - (11.0 + 0.035 * 450)) < 1e-9
    old = _Store(Reuse(mode="prefix", store_capacity_bytes=1 << 30, save_ms_per_token=0.1), 0, lambda: None)
    old.save(0, tuple(range(450)))   # a calibration stored before the fixed part: per token only
    assert abs(old.busy_ms - 45.0) < 1e-9
