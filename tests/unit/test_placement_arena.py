"""Disaggregation sized per role: the prefill worker's smaller context, the KV arena, and refusals that name
the numbers (injected RAM sizes; no model, no processes)."""
from __future__ import annotations

import pytest

from fake_nvml import GIB
from homepd.config import EngineConfig
from homepd.errors import EngineError
from homepd.hw.placement import (ARENA_SLACK_BYTES, RAM_RESERVE_BYTES, arena_bytes_for, plan_placement,
                                 prefill_context, render_plan_text)
from homepd.launch import kv_arena_bytes, prepare
from test_placement import make_box

MIB = 1 << 20


def test_prefill_context_is_a_quarter_of_n_ctx_but_at_least_512_and_at_most_n_ctx():
    assert prefill_context(4096) == 1024 and prefill_context(2048) == 512 and prefill_context(256) == 256
    assert prefill_context(4096, 3000) == 3000 and prefill_context(512, 4096) == 512


def test_each_role_holds_its_own_kv_and_the_arena_holds_the_prefill_workers():
    plan = plan_placement(make_box(ram_gib=32), 2 * GIB, GIB, prefill_kv_bytes=GIB // 4)
    d = plan.disaggregated
    assert d.feasible
    assert d.prefill.memory_bytes == 2 * GIB + GIB // 4 and d.decode.memory_bytes == 3 * GIB
    assert d.transfer_bytes == arena_bytes_for(GIB // 4) == GIB // 4 + ARENA_SLACK_BYTES
    assert d.total_bytes == d.prefill.memory_bytes + d.decode.memory_bytes + d.transfer_bytes
    text = render_plan_text(plan)
    assert "prefill 2.2 GiB (KV 256.0 MiB) + decode 3.0 GiB + KV arena 257.0 MiB" in text


def test_refuses_disaggregation_that_does_not_fit_ram_and_names_every_number():
    # 2 GiB model: prefill 2.25 GiB + decode 3 GiB + arena 257 MiB + 1 GiB reserve > 6 GiB
    plan = plan_placement(make_box(ram_gib=6), 2 * GIB, GIB, prefill_kv_bytes=GIB // 4,
                          transfer_bytes=GIB // 4 + MIB)
    d = plan.disaggregated
    assert not d.feasible and not plan.memory.fits_ram_twice and plan.colocated.feasible
    for number in ("RAM has 6.0 GiB available", "needs 6.5 GiB", "prefill worker 2.2 GiB (model 2.0 GiB + KV "
                   "256.0 MiB)", "decode worker 3.0 GiB (model 2.0 GiB + KV 1.0 GiB)", "KV arena 257.0 MiB",
                   "1.0 GiB for the system"):
        assert number in d.reason, (number, d.reason)


def test_the_default_arena_shrinks_to_fit_a_short_box_with_a_note():
    ram = 2 * GIB + GIB // 4 + 3 * GIB + RAM_RESERVE_BYTES + 100 * MIB  # 100 MiB left for the arena
    plan = plan_placement(make_box(ram_gib=ram / GIB), 2 * GIB, GIB, prefill_kv_bytes=GIB // 4)
    assert plan.disaggregated.feasible and plan.disaggregated.transfer_bytes == 100 * MIB
    assert any("KV arena shrunk to 100.0 MiB" in note for note in plan.notes)
    tight = plan_placement(make_box(ram_gib=(ram - 80 * MIB) / GIB), 2 * GIB, GIB, prefill_kv_bytes=GIB // 4)
    assert not tight.disaggregated.feasible  # under an eighth of the default: refused, not shrunk further


@pytest.mark.two_cores  # cores 0 and 1, checked against this box's
def test_launch_refuses_a_disaggregated_engine_that_does_not_fit_the_injected_box():
    config = EngineConfig(backend="fake", mode="disaggregated", n_ctx=4096, kv_arena_bytes=8 << 30)
    with pytest.raises(EngineError, match=r"KV arena needs 8.0 GiB of shared memory; RAM has 4.0 GiB available"):
        prepare(config, box=make_box(ram_gib=4))
    by_hand = EngineConfig(backend="fake", mode="disaggregated", n_ctx=4096, kv_arena_bytes=3 << 30,
                           prefill_cores=(0,), decode_cores=(1,))  # placed by hand: the RAM check still applies
    with pytest.raises(EngineError, match=r"does not fit this box's RAM: .*RAM has 4.0 GiB available.*KV arena 3.0 GiB"):
        prepare(by_hand, box=make_box(ram_gib=4))


@pytest.mark.two_cores  # cores 0 and 1, checked against this box's
def test_launch_gives_the_prefill_worker_its_context_and_the_engine_the_arena():
    box = make_box(ram_gib=32)
    setup = prepare(EngineConfig(backend="fake", mode="disaggregated", n_ctx=4096), box=box)
    assert setup.placements["prefill"].n_ctx == 1024 and setup.placements["decode"].n_ctx is None
    assert setup.kv_arena_bytes == arena_bytes_for(1024 * 1024)  # the fake model's guess: 1 KiB per token
    by_hand = EngineConfig(backend="fake", mode="disaggregated", n_ctx=4096, prefill_n_ctx=3000,
                           kv_arena_bytes=5 * MIB, prefill_cores=(0,), decode_cores=(1,))
    setup = prepare(by_hand, box=box)
    assert setup.placements["prefill"].n_ctx == 3000 and setup.kv_arena_bytes == 5 * MIB
    assert kv_arena_bytes(EngineConfig(backend="fake"), "fake://model", box) is None  # colocated: no arena


def test_the_plan_says_how_much_of_the_kv_cache_cached_prefixes_may_hold():
    from homepd.config import cached_cells_for

    assert cached_cells_for(4096, None) == 1024 and cached_cells_for(4096, 5000) == 4096
    plan = plan_placement(make_box(ram_gib=32), 2 * GIB, GIB, prefix_cache_bytes=GIB * cached_cells_for(4096, None) // 4096)
    assert plan.prefix_cache_bytes == GIB // 4
    assert "KV 1.0 GiB (cached prefixes up to 256.0 MiB of it)" in render_plan_text(plan)
    assert "cached prefixes" not in render_plan_text(plan_placement(make_box(ram_gib=32), 2 * GIB, GIB))
