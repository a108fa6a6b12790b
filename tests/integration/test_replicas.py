"""Replicas mode: n colocated workers, requests routed to the least loaded, a dead replica's requests resumed.

Uses the fake backend (real worker processes, deterministic fake model): the routing and recovery logic does
not depend on llama.cpp's numerics.  The real model's kill-and-resume continuity test for this mode is in
test_resume.py (it also shows the mode serves with llama.cpp).
"""
from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from engine_helpers import fake_text, make_engine, run
from homepd.config import EngineConfig
from homepd.core.records import WorkerEventKind
from homepd.core.sampling import SamplingParams
from homepd.fakellm import FakeModel

pytestmark = pytest.mark.whole_box  # two replicas, a core each (tests/conftest.py, BoxShare)


def fake_replicas(**kw) -> EngineConfig:
    return EngineConfig(mode="replicas", backend="fake", n_ctx=1024, **kw)


def test_requests_are_spread_over_the_replicas_and_each_is_pinned_apart():
    async def scenario():
        async with make_engine(fake_replicas()) as engine:
            streams = [await engine.submit(f"prompt {i}", params=SamplingParams(max_tokens=200, ignore_eos=True))
                       for i in range(4)]
            placed = {h.role: sorted(h.in_flight) for h in engine.workers.values()}
            texts = [text for _, text in await asyncio.gather(*(s.collect() for s in streams))]
            affinity = {w.role: psutil.Process(w.pid).cpu_affinity() for w in engine.snapshot().workers}
            roles = {s.worker_role for s in engine.steps_since()}
            return placed, texts, affinity, roles

    placed, texts, affinity, roles = run(scenario())
    assert sorted(placed) == ["replica-0", "replica-1"] and all(len(ids) == 2 for ids in placed.values())
    assert texts == [fake_text(f"prompt {i}", 200) for i in range(4)]
    assert not set(affinity["replica-0"]) & set(affinity["replica-1"])
    assert roles == {"replica-0", "replica-1"}  # the step log names each replica


def test_a_killed_replica_is_restarted_and_its_requests_resume_without_loss():
    async def scenario():
        async with make_engine(fake_replicas()) as engine:
            streams = [await engine.submit(f"prompt {i}", params=SamplingParams(max_tokens=400, ignore_eos=True))
                       for i in range(4)]
            for s in streams:
                assert (await s.__anext__()).kind == "token"
            victim = engine.workers["replica-1"]
            pid = victim.pid
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.gather(*(s.collect() for s in streams))
            await engine.wait_restarts()
            again = await engine.submit("after", params=SamplingParams(max_tokens=5, ignore_eos=True))
            _, after = await again.collect()
            return pid, streams, ends, after, engine.snapshot()

    pid, streams, ends, after, snap = run(scenario())
    assert not psutil.pid_exists(pid)
    for i, (s, (events, _)) in enumerate(zip(streams, ends)):
        assert events[-1].kind == "done"
        # nothing lost, doubled or changed, whichever replica finished it
        assert FakeModel().detokenize(s.token_ids) == fake_text(f"prompt {i}", 400)
    died = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    restarted = [e for e in snap.worker_events if e.kind is WorkerEventKind.RESTARTED]
    assert died and died[0].role == "replica-1" and len(died[0].recomputed_requests) == 2
    assert restarted and restarted[0].recovery_s is not None and restarted[0].recovery_s > 0
    assert after == fake_text("after", 5)
