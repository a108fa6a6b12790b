"""Memory accounting with the real model and real workers: each role's KV cache at its own context, the
weights mapped once, the arena once, every homepd process in the figures; and routing by the prefill
context on the real model (output as colocated)."""
from __future__ import annotations

import os

import pytest

from homepd.core.sampling import SamplingParams
from homepd.kv.pool import DATA_OFFSET
from homepd.models.gguf import read_gguf_header

from engine_helpers import PROMPTS, coloc, disagg, generate_all, make_engine, run

# disaggregated: prefill and decode on cores apart (tests/conftest.py, BoxShare)
whole_box = pytest.mark.whole_box

MIB = 1 << 20


def measured(config):
    async def scenario():
        async with make_engine(config) as engine:
            stream = await engine.submit(PROMPTS[3], params=SamplingParams(max_tokens=8, ignore_eos=True))
            await stream.collect()
            return engine.measure_memory(), engine.snapshot()

    return run(scenario())


@pytest.mark.parametrize("mode", ["colocated", pytest.param("disaggregated", marks=whole_box)])
def test_breakdown_sizes_each_roles_kv_and_counts_weights_and_arena_once(default_model_path, mode):
    header = read_gguf_header(default_model_path)
    per_token = header.kv_bytes_per_token
    config = (coloc if mode == "colocated" else disagg)(default_model_path, n_ctx=2048)
    b, snap = measured(config)
    roles = sorted(p.role for p in b.processes)
    assert roles == (["colocated", "controller"] if mode == "colocated" else ["controller", "decode", "prefill"])
    assert all(p.pid for p in b.processes) and os.getpid() in [p.pid for p in b.processes]
    # the weights' file pages, mapped by every worker, counted once
    assert 0.8 * header.size_bytes <= b.weights_shared_bytes <= os.path.getsize(default_model_path)
    # llama.cpp's KV caches: the decode (colocated) worker's for n_ctx, the prefill worker's for its own context
    n_cells = 2048 + (snap.kv_arena.prefill_n_ctx if mode == "disaggregated" else 0)
    assert abs(b.kv_cache_bytes - n_cells * per_token) < 0.05 * n_cells * per_token + 4 * MIB, b
    if mode == "disaggregated":
        assert snap.kv_arena.prefill_n_ctx == 512
        assert b.arena_bytes == DATA_OFFSET + snap.kv_arena.capacity_bytes  # pre-faulted, counted once
        assert snap.kv_arena.capacity_bytes == -(-(512 * per_token + MIB) // MIB) * MIB
    else:
        assert b.arena_bytes == 0 and snap.kv_arena is None
    assert snap.memory is b  # the snapshot carries the last measurement
    # PSS splits shared pages with every process that maps them, a test run outside homepd mapping the same GGUF
    # included; counted once at their resident size, the total is never below the PSS sum, and above it by
    # no more than the shared weights and arena
    pss_sum = sum(p.pss_bytes for p in b.processes)
    assert pss_sum - MIB <= b.total_bytes <= pss_sum + b.weights_shared_bytes + b.arena_bytes


@whole_box
def test_a_prompt_longer_than_the_prefill_context_is_prefilled_on_decode_with_colocated_output(default_model_path):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # 289 tokens: over a 256-token prefill context (llama.cpp's smallest: it pads n_ctx to 256); 5: under it
    prompts = [" ".join(PROMPTS * 2 + PROMPTS[3:]), PROMPTS[0]]
    col, _, _ = run(generate_all(coloc(default_model_path, n_threads=1), prompts, params))
    dis, steps, records = run(generate_all(disagg(default_model_path, prefill_n_ctx=256), prompts, params))
    assert dis == col
    assert records[0].kv_bytes is None and records[1].kv_bytes  # the long one never went through the arena
    assert any(rid == records[0].request_id for s in steps if s.worker_role == "decode" for rid, _ in s.prefill)
