"""A running engine's snapshot survives its JSON (what ``/status`` sends and the app decodes): real worker
processes on the fake backend, taken with KV in transit, memory measured, and after a worker death."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from homepd.config import EngineConfig
from homepd.core.records import EngineSnapshot, WorkerEventKind
from homepd.core.sampling import SamplingParams

from engine_helpers import make_engine, run

pytestmark = [pytest.mark.timeout(120), pytest.mark.whole_box]  # disaggregated (tests/conftest.py, BoxShare)


def through_json(snap: EngineSnapshot) -> EngineSnapshot:
    return EngineSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))


def test_a_live_disaggregated_snapshot_comes_back_from_json_unchanged():
    # one decode sequence: the second and third handoffs wait in the arena while the first decodes
    cfg = EngineConfig(backend="fake", mode="disaggregated", n_ctx=2048, n_seq_max=1, chunk=64, prefill_threads=1,
                       decode_threads=1, kv_arena_bytes=8 * 4096, n_extents=3, local_prefill=False)

    async def scenario():
        async with make_engine(cfg) as engine:
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                       for p, n in (("first prompt", 200), ("second one", 8), ("third one", 8))]
            async for event in streams[0]:
                assert event.kind == "token", "the first request ended before two handoffs were in the arena"
                if len(engine.handoff.router.in_arena) == 2:
                    break
            engine.measure_memory()
            in_transit = engine.snapshot()
            os.kill(engine.workers["decode"].pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            await engine.wait_restarts()
            return in_transit, engine.snapshot()

    in_transit, after = run(scenario())
    assert in_transit.kv_arena.n_extents == 2 and in_transit.kv_arena.used_bytes > 0
    assert in_transit.memory is not None and in_transit.admission is not None and in_transit.requests
    assert {e.kind for e in after.worker_events} >= {WorkerEventKind.DIED, WorkerEventKind.RESTARTED}
    for snap in (in_transit, after):
        assert through_json(snap) == snap
