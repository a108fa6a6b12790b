"""Request classes reach the engine: each request carries its class, the snapshot counts them, a bad one is
refused before any worker sees it (fake backend: real worker processes, no model)."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import make_engine, run
from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.errors import RequestError


def test_each_request_carries_its_class_and_the_snapshot_counts_them():
    async def scenario():
        async with make_engine(EngineConfig(backend="fake", n_ctx=2048)) as engine:
            long = SamplingParams(max_tokens=500, ignore_eos=True)
            streams = [await engine.submit("chat", params=long),
                       await engine.submit("summary", params=long, request_class="background"),
                       await engine.submit("voice", params=long, request_class="interactive")]
            counts = engine.snapshot().requests_by_class
            with pytest.raises(RequestError, match="interactive, background"):
                await engine.submit("x", request_class="urgent")
            for s in streams:
                engine.cancel(s.request_id)
            await asyncio.gather(*(s.collect() for s in streams))
            return [s.lifecycle for s in streams], counts, engine.snapshot().requests_by_class

    lcs, counts, after = run(scenario())
    assert [lc.request_class for lc in lcs] == ["interactive", "background", "interactive"]
    assert counts == {"interactive": 2, "background": 1} and after == {}
    assert lcs[1].to_dict()["request_class"] == "background"
