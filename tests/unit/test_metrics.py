from __future__ import annotations

import pytest

from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.protocol import StepRecord
from homepd.core.records import to_plain
from homepd.measure.metrics import interference, percentile, summarize


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


def test_the_kv_summary_names_the_extent_wait_and_keeps_its_old_slot_name_in_json():
    lc = Lifecycle("r", arrived_s=0.0, n_prompt_tokens=8)
    lc.advance(RequestState.PREFILLING, 0.1)
    lc.prefill_end_s = 0.2
    lc.advance(RequestState.TRANSFERRING, 0.2)
    lc.kv_bytes, lc.kv_export_s, lc.kv_import_s, lc.kv_extent_wait_s = 4096, 0.001, 0.001, 0.03
    lc.transfer_end_s = 0.25
    lc.advance(RequestState.DECODING, 0.25)
    lc.add_token(0.3)
    lc.advance(RequestState.FINISHED, 0.3)
    kv = summarize([lc], []).kv
    assert kv.extent_wait_ms_p95 == pytest.approx(30)
    assert to_plain(kv)["extent_wait_ms_p95"] == to_plain(kv)["slot_wait_ms_p95"] == kv.extent_wait_ms_p95
