"""Replaying an arrival trace on a running engine, and the run's memory and energy.

Each request is submitted at its arrival offset (real time) and drained; the
caller gets their lifecycles, from which ``homepd.measure.metrics`` derives
every latency figure.
"""
from __future__ import annotations

import asyncio
import time

from homepd.core.sampling import SamplingParams
from homepd.hw.monitor import energy_by_source_j


async def replay(engine, trace, on_done=None) -> list:
    """Submit each trace request at its arrival offset; wait for all; return their lifecycles."""
    t0 = time.monotonic()

    async def one(req):
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
        stream = await engine.submit(messages=req.messages, params=SamplingParams(max_tokens=req.max_tokens))
        await stream.collect()
        if on_done:
            on_done(stream)
        return stream.lifecycle

    return list(await asyncio.gather(*(one(r) for r in trace)))


def memory_and_energy(sampler, t0_s: float, t1_s: float) -> dict:
    """Per worker role, peak RSS/USS/PSS during [t0, t1]; energy per source (None = NA on this box)."""
    history = [s for s in sampler.history() if t0_s <= s.t_mono_s <= t1_s] or list(sampler.history())[-1:]
    workers: dict[str, dict] = {}
    for snap in history:
        for p in snap.processes:
            w = workers.setdefault(p.role, {"rss_bytes": None, "uss_bytes": None, "pss_bytes": None})
            for key in w:
                value = getattr(p, key)
                if value is not None and (w[key] is None or value > w[key]):
                    w[key] = value
    return {"workers": workers, "energy_j": energy_by_source_j(list(sampler.history()), t0_s, t1_s)}
