"""The KV arena in a running engine (real worker processes, the fake backend): routing at admission,
back-pressure, kill -9 of either worker mid-handoff, and what the arena's bookkeeping looks like afterwards."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from homepd.config import EngineConfig
from homepd.core.records import WorkerEventKind
from homepd.core.sampling import SamplingParams
from homepd.kv.pool import extent_bytes_for

from engine_helpers import make_engine, run

pytestmark = pytest.mark.whole_box  # every test is disaggregated: prefill and decode on cores apart (conftest.py)

LONG = "a long prompt about the sea " * 80   # 2241 fake tokens: 8976 bytes of KV state, 4 pages with its header
SHORT = ["hi", "what is the weather like", "tell me a story about a cat", "one two three"]


def fake(mode: str = "disaggregated", **kw) -> EngineConfig:
    base = dict(backend="fake", mode=mode, n_ctx=4096, n_seq_max=4, chunk=64, prefill_threads=1, decode_threads=1)
    return EngineConfig(**{**base, **kw})


async def generate(engine, prompts, max_tokens=24):
    streams = [await engine.submit(p, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
               for p in prompts]
    results = await asyncio.gather(*(s.collect() for s in streams))
    return streams, [events for events, _ in results]


async def assert_arena_settled(engine) -> None:
    """Nothing in transit, and one more export finds the prefill worker's allocator holding nothing but
    its own extent: no byte of the arena was lost to a death or a cancel."""
    snap = engine.snapshot().kv_arena
    assert snap.in_arena == () and sum(snap.occupancy.values()) == 0
    streams, ends = await generate(engine, ["one more"], max_tokens=4)
    assert ends[0][-1].kind == "done" and streams[0].lifecycle.kv_bytes
    used, kv = engine.handoff.router.usage[-1][1:]
    assert used == extent_bytes_for(kv), (used, kv)


def test_an_arena_smaller_than_one_prompts_kv_routes_it_to_decode_and_the_others_continue():
    # 8 KiB: one header page and one payload page; the prefill context (n_ctx) would hold the long prompt
    cfg = fake(kv_arena_bytes=8192, prefill_n_ctx=4096)

    async def scenario():
        async with make_engine(cfg) as engine:
            assert not engine.handoff.router.fits_prefill_worker(2241) and engine.handoff.router.fits_prefill_worker(20)
            streams, ends = await generate(engine, [LONG, *SHORT])
            return streams, ends, engine.steps_since(), engine.snapshot()

    streams, ends, steps, snap = run(scenario())

    async def colocated():
        async with make_engine(fake("colocated", n_threads=1)) as engine:
            return await generate(engine, [LONG, *SHORT])
    reference, _ = run(colocated())
    for s, r, events in zip(streams, reference, ends):
        assert events[-1].kind == "done" and s.token_ids == r.token_ids  # same output as colocated
    long_id = streams[0].request_id
    assert streams[0].lifecycle.kv_bytes is None  # never in the arena...
    # ...prefilled on the decode worker
    assert any(rid == long_id for st in steps if st.worker_role == "decode" for rid, _ in st.prefill)
    assert all(s.lifecycle.kv_bytes for s in streams[1:])  # the others went through the arena
    assert snap.kv_arena.capacity_bytes == 8192 and snap.kv_arena.peak_used_bytes <= 8192


def test_a_prompt_longer_than_the_prefill_context_is_prefilled_on_the_decode_worker():
    async def scenario():
        async with make_engine(fake(prefill_n_ctx=512)) as engine:  # the arena (default) would hold it
            assert not engine.handoff.router.fits_prefill_worker(2241)
            return await generate(engine, [LONG, SHORT[0]])

    streams, ends = run(scenario())
    assert [e[-1].kind for e in ends] == ["done", "done"]
    assert streams[0].lifecycle.kv_bytes is None and streams[1].lifecycle.kv_bytes


def test_many_concurrent_handoffs_share_the_arena_by_bytes():
    """A small arena and more prompts than it holds at once: prefill waits, never fails; the peak use
    stays within the arena and close to the KV actually in transit."""
    prompts = [f"prompt number {i} " * (10 + 15 * (i % 4)) for i in range(12)]  # all within the prefill context

    async def scenario():
        # every prompt through the prefill worker and the arena (no short prompt prefilled on the decode worker)
        cfg = fake(kv_arena_bytes=5 * 4096, n_seq_max=2, n_extents=8, local_prefill=False)
        async with make_engine(cfg) as engine:
            streams, ends = await generate(engine, prompts, max_tokens=40)
            await assert_arena_settled(engine)
            return streams, ends, engine.snapshot().kv_arena

    streams, ends, snap = run(scenario())
    assert all(e[-1].kind == "done" for e in ends) and all(s.lifecycle.kv_bytes for s in streams)
    assert any(s.lifecycle.kv_extent_wait_s > 0 for s in streams)  # back-pressure happened
    assert snap.peak_kv_bytes < snap.peak_used_bytes <= 5 * 4096


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_kill_9_of_either_worker_mid_handoff_leaves_the_arena_consistent_and_requests_resume(victim):
    """One decode sequence, so handoffs queue in the arena; the prefill worker holds more that wait for room.
    Kill ``victim`` while KV is in transit: every request completes (from the arena or by recompute), and
    afterwards the arena's bytes are all accounted for."""
    cfg = fake(kv_arena_bytes=4 * 4096, n_seq_max=1, n_extents=2)
    lengths = [300, 20, 20, 20, 20]

    async def scenario():
        async with make_engine(cfg) as engine:
            pid = engine.workers[victim].pid
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                       for p, n in zip([*SHORT, "last one"], lengths)]
            async for event in streams[0]:  # request 0 decodes while two handoffs wait in the arena
                assert event.kind == "token", "request 0 ended before two handoffs were in the arena"
                if len(engine.handoff.router.in_arena) == 2:
                    break
            in_transit = set(engine.handoff.router.in_arena)
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            await engine.wait_restarts()
            await assert_arena_settled(engine)
            return streams, ends, in_transit, engine.snapshot()

    streams, ends, in_transit, snap = run(scenario())
    for s, (events, _), n in zip(streams, ends, lengths):
        assert events[-1].kind == "done" and len(s.token_ids) == n, (s.request_id, events[-1])
    (died,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    assert died.role == victim and died.failed_requests == ()
    if victim == "decode":  # what waited in the arena was imported again, not prefilled again
        assert set(died.resumed_from_extent) == in_transit
    else:  # the prefill worker's death leaves the arena's handoffs to the decode worker
        assert not in_transit & set(died.recomputed_requests)
