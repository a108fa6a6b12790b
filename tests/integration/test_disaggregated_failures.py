"""Disaggregated failures: refused extents (the real model's KV state), killed workers (with resume) and a
killed controller (the fake backend: real processes and shared memory, no model), /dev/shm hygiene."""
from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from homepd.core.lifecycle import RESUMED_FROM_EXTENT
from homepd.core.records import WorkerEventKind
from homepd.fakellm import FakeModel
from homepd.kv.header import ExtentHeader
from homepd.kv.segment import parse_segment_name
from homepd.kv.pool import KVArena, extent_bytes_for
from homepd.llm import LlamaContext, LlamaModel
from homepd.core.protocol import KVHandoff, RequestDone
from homepd.models.resolve import fingerprint
from homepd.core.sampling import SamplingParams
from homepd.chat.textstream import TextStream
from homepd.core.protocol import WorkerSpec
from homepd.worker.loop import WorkerLoop

from engine_helpers import PROMPTS, fake_disagg, fake_text, make_engine, run, start_controller_and_kill_it
from worker_fakes import Outbox

# every engine here is disaggregated: prefill and decode on cores apart (conftest.py).  Alone, not two_cores: these
# tests assert that no dead owner's segment is left on the box, which another worker's kill -9 test beside them
# breaks for a moment (the autouse leak check counts only this process's children: tests/conftest.py).  The
# refused extents need neither: one worker's loop in this process, its arena this process's
whole_box = pytest.mark.whole_box


def shm_segments_of_dead_owners() -> list[str]:
    out = []
    for name in os.listdir("/dev/shm"):
        parsed = parse_segment_name(name)
        if parsed and not psutil.pid_exists(parsed[0]):
            out.append(name)
    return out


@pytest.mark.parametrize("bad", ["fingerprint", "n_ctx", "checksum"])
def test_decode_worker_refuses_a_mismatched_or_corrupted_extent(default_model_path, bad):
    fp = fingerprint(default_model_path)
    model = LlamaModel(default_model_path)
    spec = WorkerSpec(role="decode", model_path=str(default_model_path), n_ctx=512, n_seq_max=2, chunk=64,
                      n_threads=1, model_fingerprint=fp)
    ctx = LlamaContext(model, n_ctx=512, n_batch=64, n_seq_max=2, n_threads=1)
    ids = model.tokenize(PROMPTS[1])
    ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * len(ids))
    n = ctx.state_size(0)
    ctx.seq_rm(0)
    outbox = Outbox()
    loop = WorkerLoop(spec, model, ctx, outbox)
    extent = extent_bytes_for(n)
    with KVArena.create(extent) as arena:
        loop.role.arena = KVArena.attach(list(arena.names))
        offset = 0
        arena.begin(offset, extent)
        ctx2 = LlamaContext(model, n_ctx=512, n_batch=64, n_seq_max=1, n_threads=1)
        ctx2.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * len(ids))
        ctx2.state_get(0, arena.payload(offset, n, "r1"))
        ctx2.close()
        # n_ctx: KV that claims more tokens than this decode worker's context holds
        header = ExtentHeader("r1", "0" * 64 if bad == "fingerprint" else fp, 1024 if bad == "n_ctx" else 512,
                              600 if bad == "n_ctx" else len(ids), n)
        arena.publish(offset, header)
        if bad == "checksum":
            arena._buf[4096 + 4096 + 100] ^= 0xFF  # flip a payload byte inside the fully checked head
        params = SamplingParams(max_tokens=4)
        loop.handle(KVHandoff("r1", offset, tuple(ids), (42,), params, TextStream(), n,
                              len(ids), 0.0, 0.0, 0.0, extent_bytes=extent))
        loop.role.pump()
        (done,) = outbox.sent
        assert isinstance(done, RequestDone) and done.reason == "error"
        assert "KV import refused" in done.error and bad.replace("_", "") in done.error.replace("_", "").lower()
        assert arena.state(offset).name == "FREE"          # the extent is usable again
        assert loop.scheduler.allocator.free_seq_ids and not loop.scheduler.running  # the sequence too
        loop.role.arena.close()
    outbox.close()
    ctx.close()
    model.close()


@whole_box
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_kill_9_during_three_streams_ends_all_and_engine_recovers(victim):
    """Without resume: what the worker held ends with an error; the rest goes on."""
    async def scenario():
        async with make_engine(fake_disagg(resume=False)) as engine:
            pid = engine.workers[victim].pid
            # why 3000: at the fake's ~2000 tokens/s the streams are still decoding when the kill lands
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=3000, ignore_eos=True))
                       for p in PROMPTS[:3]]
            for s in streams:  # two tokens each: the second comes from the decode worker
                assert (await s.__anext__()).kind == "token"
                assert (await s.__anext__()).kind == "token"
            if victim == "prefill":
                # keep the prefill worker busy with a long prompt (~150 chunks) when it dies
                late = await engine.submit(" ".join(PROMPTS * 24), params=SamplingParams(max_tokens=4))
                streams.append(late)
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.gather(*(s.collect() for s in streams))
            again = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=4, ignore_eos=True))
            events, _ = await asyncio.wait_for(again.collect(), timeout=60)
            assert events[-1].kind == "done" and sum(e.kind == "token" for e in events) == 4
            assert not shm_segments_of_dead_owners()
            return pid, engine.snapshot(), streams, ends

    pid, snap, streams, ends = run(scenario())
    assert not psutil.pid_exists(pid)
    (died,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    assert died.role == victim and died.cause == f"exit code {-signal.SIGKILL}"  # its exit, not a hang
    kinds = [events[-1].kind for events, _ in ends]
    assert "error" in kinds  # requests it held are not silently lost
    for s, (events, _) in zip(streams, ends):
        if events[-1].kind == "error":  # one it held: ended by the handling of the death itself
            assert f"pid {pid}" in events[-1].error and victim in events[-1].error
            assert s.request_id in died.failed_requests and events[-1].t_s == died.t_s
        else:  # one it did not hold: untouched, it ran to its length
            assert events[-1].finish_reason == "length" and len(s.token_ids) == s.params.max_tokens
    assert not shm_segments_of_dead_owners()


@whole_box
def test_decode_death_resumes_every_request():
    """n_seq_max=1: while request 0 decodes, requests 1 and 2 wait in READY extents.  Kill the decode
    worker: 1 and 2 are imported from their extents by the restarted worker (no second prefill); 0 lost
    its KV and is resumed by recompute (prompt + its output prefilled again).  All complete, each with
    exactly the text it would have had undisturbed."""
    n_out = 1000  # why: request 0 still decodes (~0.5 s on the fake) when the others are in their extents

    async def scenario():
        async with make_engine(fake_disagg(n_seq_max=1, n_extents=3)) as engine:
            pid = engine.workers["decode"].pid
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n_out, ignore_eos=True))
                       for p in PROMPTS[:3]]
            for _ in range(3):  # request 0 is decoding on the decode worker
                assert (await streams[0].__anext__()).kind == "token"
            async for event in streams[0]:  # it decodes on while both others are exported into extents
                assert event.kind == "token", "request 0 ended before requests 1 and 2 were in extents"
                if len(engine.snapshot().kv_arena.in_arena) == 2:
                    break
            waiting = list(engine.snapshot().kv_arena.in_arena)
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            # prompt tokens prefilled per request, on either worker
            steps = engine.steps_since()
            prefilled = {s.request_id: sum(n for st in steps for rid, n in st.prefill if rid == s.request_id)
                         for s in streams}
            return streams, ends, waiting, engine.snapshot(), prefilled

    streams, ends, waiting, snap, prefilled = run(scenario())
    assert waiting == sorted(s.request_id for s in streams[1:])
    for prompt, s, (events, _) in zip(PROMPTS, streams, ends):
        assert events[-1].kind == "done" and events[-1].finish_reason == "length"
        assert FakeModel().detokenize(s.token_ids) == fake_text(prompt, n_out)
    assert len(streams[0].token_ids) == n_out  # 3 before the kill + the rest after recompute
    first = streams[0].lifecycle
    assert first.resumed_by == ["recompute"] and prefilled[first.request_id] > 2 * first.n_prompt_tokens  # again
    for s in streams[1:]:
        assert s.lifecycle.resumed_by == [RESUMED_FROM_EXTENT]
        assert prefilled[s.request_id] == s.lifecycle.n_prompt_tokens
        assert len(s.token_ids) == n_out
    died = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED][0]
    assert list(died.resumed_from_extent) == waiting and list(died.recomputed_requests) == [streams[0].request_id]
    assert died.failed_requests == ()


CONTROLLER = """
import asyncio, sys
from homepd.config import EngineConfig
from homepd.engine.controller import Engine
from homepd.launch import prepare
from homepd.core.sampling import SamplingParams
async def main():
    cfg = EngineConfig(backend="fake", mode="disaggregated", n_ctx=16384, prefill_threads=1, decode_threads=1)
    engine = Engine(cfg, prepare(cfg, pull=False))
    await engine.start()
    s = await engine.submit("Count to one hundred:", params=SamplingParams(max_tokens=10000, ignore_eos=True))
    await s.__anext__()
    print(engine.workers["prefill"].pid, engine.workers["decode"].pid, *engine.handoff.router.arena.names, flush=True)
    await asyncio.sleep(3600)   # stands for a controller busy forever; the test kills it
asyncio.run(main())
"""


@whole_box
def test_killed_controller_leaves_no_worker_and_no_segment():
    def segments_exist(words):
        assert words[2:] and all(os.path.exists(f"/dev/shm/{n}") for n in words[2:])

    words, alive = start_controller_and_kill_it(CONTROLLER, before_kill=segments_exist)
    names = words[2:]
    assert not alive
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)  # the workers unlinked them
