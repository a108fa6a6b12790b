"""Failures of a running engine: killed workers, cancel, bad input, no orphans.

Process and recovery logic runs on the fake backend (real worker processes, no model); the model files and
a restart that cannot load its model use the real one."""
from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from homepd.core.records import WorkerEventKind
from homepd.errors import ModelError, RequestError
from homepd.core.sampling import SamplingParams

from engine_helpers import PROMPTS, coloc, fake_coloc, make_engine, run, start_controller_and_kill_it

# why: the fake backend makes ~2000 tokens/s here; a stream this long is still running when a test acts on it
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


def test_kill_9_of_worker_fails_streams_at_once_and_engine_recovers():
    async def scenario():
        async with make_engine(fake_coloc(resume=False)) as engine:
            pid = engine.workers["colocated"].pid
            streams = [await engine.submit(p, params=LONG)
                       for p in PROMPTS[:3]]
            for s in streams:  # every request is streaming
                first = await s.__anext__()
                assert first.kind == "token"
            os.kill(pid, signal.SIGKILL)
            ends = await asyncio.gather(*(s.collect() for s in streams))
            # a new request is served by the restarted worker
            again = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=4))
            events, text = await again.collect()
            assert events[-1].kind == "done" and text
            new_pid = engine.workers["colocated"].pid
            return pid, new_pid, ends, engine.snapshot()

    pid, new_pid, ends, snap = run(scenario())
    assert new_pid != pid and not psutil.pid_exists(pid)
    assert snap.workers[0].restarts == 1
    (died,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    assert died.exitcode == -signal.SIGKILL and len(died.failed_requests) == 3
    assert died.cause == f"exit code {-signal.SIGKILL}"  # noticed by its exit (pipe EOF), not as hung
    for events, _ in ends:
        last = events[-1]
        assert last.kind == "error" and f"pid {pid}" in last.error and "died" in last.error
        assert last.t_s == died.t_s  # ended by the handling of the death itself, not later
    (restarted,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.RESTARTED]
    assert restarted.pid == new_pid and restarted.recovery_s == restarted.t_s - died.t_s > 0


def test_over_long_prompt_and_bad_sampling_refused_before_worker():
    async def scenario():
        async with make_engine(fake_coloc(n_ctx=128)) as engine:
            with pytest.raises(RequestError, match=r"prompt is \d+ tokens; the context holds 128"):
                await engine.submit("word " * 400)
            with pytest.raises(RequestError, match="temperature"):
                await engine.submit("hi", params=SamplingParams(temperature=-1))
            with pytest.raises(RequestError, match="exactly one of prompt or messages"):
                await engine.submit()
            with pytest.raises(RequestError, match=r"messages\[0\].role"):
                await engine.submit(messages=[{"role": "wizard", "content": "x"}])
            assert engine.requests.step_log.maxlen and len(engine.requests.step_log) == 0  # nothing reached the worker
            # max_tokens beyond the context is clamped and ends with 'length'
            stream = await engine.submit("word " * 10, params=SamplingParams(max_tokens=1000, ignore_eos=True))
            events, _ = await stream.collect()
            assert events[-1].finish_reason == "length"
            n_out = sum(e.kind == "token" for e in events)
            assert stream.lifecycle.n_prompt_tokens + n_out == 128 + 1
            # the engine still serves
            ok = await engine.submit("Hello", params=SamplingParams(max_tokens=3))
            events, _ = await ok.collect()
            assert events[-1].kind == "done"

    run(scenario())


@pytest.mark.parametrize("content,match", [
    (None, "no such file"),
    (b"", "empty|too small|truncated"),
    (b"PK\x03\x04" + b"\0" * 4096, "not a GGUF"),
])
def test_bad_model_file_is_a_clear_error(tmp_path, content, match):
    path = tmp_path / "broken.gguf"
    if content is not None:
        path.write_bytes(content)

    async def scenario():
        with pytest.raises(ModelError, match=match) as info:
            make_engine(coloc(path))
        assert "broken.gguf" in str(info.value)

    run(scenario())


def test_truncated_real_model_is_a_clear_error(default_model_path, tmp_path):
    path = tmp_path / "half.gguf"
    with open(default_model_path, "rb") as src:
        path.write_bytes(src.read(default_model_path.stat().st_size // 2))

    async def scenario():
        with pytest.raises(ModelError, match="half.gguf") as info:
            make_engine(coloc(path))
        assert "truncated" in str(info.value)

    run(scenario())


def test_cancel_ends_stream_and_frees_the_sequence():
    async def scenario():
        async with make_engine(fake_coloc(n_seq_max=1)) as engine:
            long = await engine.submit(PROMPTS[0], params=LONG)
            await long.__anext__()
            assert engine.cancel(long.request_id)
            events, _ = await long.collect()
            assert events[-1].kind == "done" and events[-1].finish_reason == "cancelled"
            assert long.lifecycle.state.value == "cancelled"
            # the only sequence is free again
            nxt = await engine.submit(PROMPTS[1], params=SamplingParams(max_tokens=3))
            events, _ = await nxt.collect()
            assert events[-1].finish_reason in ("length", "stop")

    run(scenario())


def test_stop_leaves_no_child_process():
    async def scenario():
        engine = make_engine(fake_coloc())
        await engine.start()
        pid = engine.workers["colocated"].pid
        stream = await engine.submit(PROMPTS[0], params=LONG)
        await stream.__anext__()
        await engine.stop()
        events, _ = await stream.collect()
        assert events[-1].kind == "error" and "engine stopped" in events[-1].error
        return pid

    pid = run(scenario())
    assert not psutil.pid_exists(pid)
    assert not psutil.Process().children(recursive=True)


CONTROLLER = """
import asyncio, sys
from homepd.config import EngineConfig
from homepd.engine.controller import Engine
from homepd.launch import prepare
from homepd.core.sampling import SamplingParams
async def main():
    cfg = EngineConfig(backend="fake", n_ctx=16384, n_threads=1)
    engine = Engine(cfg, prepare(cfg, pull=False))
    await engine.start()
    s = await engine.submit("Count to one hundred:", params=SamplingParams(max_tokens=10000, ignore_eos=True))
    await s.__anext__()
    print(engine.workers["colocated"].pid, flush=True)
    await asyncio.sleep(3600)   # stands for a controller busy forever; the test kills it
asyncio.run(main())
"""


def test_killed_controller_leaves_no_worker_behind():
    words, alive = start_controller_and_kill_it(CONTROLLER)
    assert len(words) == 1 and not alive


def test_worker_that_cannot_restart_refuses_new_work_clearly(default_model_path, tmp_path, monkeypatch):
    import shutil

    from homepd.engine import recovery
    from homepd.errors import EngineError

    # the three attempts still run, with a tenth of the back-off (0.5 + 1 + 2 s of waiting otherwise)
    monkeypatch.setattr(recovery, "RESTART_BACKOFF_S", 0.05)

    copy = tmp_path / "model.gguf"
    shutil.copy(default_model_path, copy)

    async def scenario():
        async with make_engine(coloc(copy, resume=False)) as engine:
            handle = engine.workers["colocated"]
            stream = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=300, ignore_eos=True))
            await stream.__anext__()
            copy.write_bytes(b"GGUF")  # the model is gone from under us: no restart can load it
            os.kill(handle.pid, signal.SIGKILL)
            events, _ = await stream.collect()
            assert events[-1].kind == "error"
            # accepted while the restarts (three attempts with back-off) run; ends when they give up
            queued = await engine.submit(PROMPTS[1], params=SamplingParams(max_tokens=4))
            queued_events, _ = await queued.collect()
            assert handle.failed
            with pytest.raises(EngineError, match="could not be restarted"):
                await engine.submit(PROMPTS[0])
            return queued_events, engine.snapshot()

    queued_events, snap = run(scenario())
    assert queued_events[-1].kind == "error" and "colocated worker could not be restarted" in queued_events[-1].error
    assert snap.workers[0].alive is False
    assert [e.kind for e in snap.worker_events] == [WorkerEventKind.DIED, WorkerEventKind.FAILED]
