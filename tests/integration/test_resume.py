"""Resume after kill -9 or a hang: every request completes, and what it generated stays a consistent
continuation.  One real-model test per architecture (the teacher-forced check); the recovery logic — which
worker dies, KV arena extents, recompute, hangs, giving up — on the fake backend, whose output is known exactly."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from homepd.config import EngineConfig
from homepd.core.records import WorkerEventKind
from homepd.fakellm import FakeModel
from homepd.llm import LlamaModel
from homepd.measure.reference import teacher_forced_deficits
from homepd.core.sampling import SamplingParams

from engine_helpers import N_THREADS, fake_coloc, fake_disagg, fake_text, make_engine, PROMPTS, run
from test_engine_correctness import MARGIN_LOGITS

N_OUT = 24
# why: a stop string that never matches still makes the text stream hold back its last characters,
# so a resume that lost the held-back text would show in the streamed text
NEVER = "\x00never"


def whole_box(*values):
    """A parameter set that needs every core (disaggregated, replicas): tests/conftest.py, BoxShare."""
    return pytest.param(*values, marks=pytest.mark.whole_box)


async def kill_mid_stream(cfg: EngineConfig, victim: str, n_out: int, late_prompt: str):
    """Three requests streaming (a fourth just submitted when the prefill worker is the victim); kill -9
    ``victim``; return (pid, streams, their ends, snapshot, streamed text per request)."""
    async with make_engine(cfg) as engine:
        params = SamplingParams(max_tokens=n_out, ignore_eos=True, stop=(NEVER,))
        streams = [await engine.submit(p, params=params) for p in PROMPTS[:3]]
        texts = {s.request_id: "" for s in streams}
        # two tokens each: in disaggregated mode the second comes from the decode worker.  Replicas: only the
        # victim's requests are waited for (a request alone on a replica ends all its tokens in well under a
        # second, while the other replica still prefills two prompts: waiting for those first, it was gone)
        held = [s for s in streams if cfg.mode != "replicas" or s.lifecycle.routed_to == victim]
        for s in held:
            texts[s.request_id] += (await s.__anext__()).text + (await s.__anext__()).text
        if victim == "prefill":  # give the prefill worker something to lose
            streams.append(await engine.submit(late_prompt, params=params))
            texts[streams[-1].request_id] = ""
        pid = engine.workers[victim].pid
        os.kill(pid, signal.SIGKILL)
        ends = await asyncio.gather(*(s.collect() for s in streams))
        # replicas: the survivor can finish every request before the replacement has loaded its model
        await engine.wait_restarts()
        for s, (events, text) in zip(streams, ends):
            texts[s.request_id] += text
        return pid, streams, ends, engine.snapshot(), texts


def check_recovery(pid, victim, snap):
    """One death of ``victim`` (noticed by its exit), one restart; returns (restarted event, resumed ids)."""
    (died,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    assert died.role == victim and died.pid == pid and not died.failed_requests
    assert died.cause == f"exit code {-signal.SIGKILL}"  # noticed by its exit (pipe EOF), not as hung
    (restarted,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.RESTARTED]
    assert restarted.role == victim and restarted.recovery_s == restarted.t_s - died.t_s > 0
    resumed = set(died.resumed_from_extent) | set(died.recomputed_requests)
    assert resumed  # the dead worker held something, and it came back
    return restarted, resumed


@pytest.mark.parametrize("mode,victim", [("colocated", "colocated"), whole_box("disaggregated", "decode"),
                                         whole_box("replicas", "replica-1")])
def test_kill_9_with_resume_completes_every_request_as_a_consistent_continuation(default_model_path, mode, victim):
    """The real model, one test per architecture: what the replacement generates continues what was
    streamed (teacher-forced: every token is the model's choice after the prompt and the tokens before)."""
    cfg = EngineConfig(model=str(default_model_path), mode=mode, n_ctx=2048, n_seq_max=4, chunk=64, n_threads=N_THREADS,
                       prefill_threads=1, decode_threads=1)
    pid, streams, ends, snap, texts = run(kill_mid_stream(cfg, victim, N_OUT, PROMPTS[3]))
    restarted, resumed = check_recovery(pid, victim, snap)
    model = LlamaModel(default_model_path)
    for prompt, s, (events, _) in zip(PROMPTS, streams, ends):
        assert events[-1].kind == "done"
        assert len(s.token_ids) == N_OUT
        assert texts[s.request_id] == model.detokenize(s.token_ids)  # nothing lost or doubled at the resume
        if s.request_id in resumed:  # colocated: finished by the replacement; disaggregated and replicas: by
            # whichever worker can take it first (the prefill worker recomputes it; the other replica), which on a
            # loaded box can be before the replacement is up (seen with the suite on one core)
            assert s.lifecycle.n_resumes == 1 and (mode != "colocated" or events[-1].t_s > restarted.t_s)
        deficits = teacher_forced_deficits(model, model.tokenize(prompt), s.token_ids, n_threads=N_THREADS,
                                           ignore_eos=True)
        assert max(deficits) <= MARGIN_LOGITS, (s.lifecycle.resumed_by, deficits)
    model.close()


@pytest.mark.parametrize("mode,victim", [("colocated", "colocated"), whole_box("disaggregated", "decode"),
                                         whole_box("disaggregated", "prefill")])  # replicas: test_replicas.py
def test_kill_9_with_resume_continues_every_stream_exactly_on_the_fake_backend(mode, victim):
    """Whichever worker dies, every request ends with exactly the text it would have had undisturbed."""
    n_out = 2000  # why: at the fake's ~2000 tokens/s the streams are still running when the kill lands
    cfg = fake_coloc(mode=mode) if mode != "disaggregated" else fake_disagg()
    # a prompt of ~100 chunks: the prefill worker still holds it when it is killed
    late = PROMPTS[3] * 20
    pid, streams, ends, snap, texts = run(kill_mid_stream(cfg, victim, n_out, late))
    restarted, resumed = check_recovery(pid, victim, snap)
    for prompt, s, (events, _) in zip([*PROMPTS[:3], late], streams, ends):
        assert events[-1].kind == "done" and len(s.token_ids) == n_out
        assert texts[s.request_id] == fake_text(prompt, n_out)  # nothing lost, doubled or changed
        if s.request_id in resumed:
            assert s.lifecycle.n_resumes == 1 and events[-1].t_s > restarted.t_s


@pytest.mark.whole_box  # disaggregated
def test_prefill_death_resumes_a_request_waiting_for_an_extent():
    """One extent, one decode sequence: request 0 decodes, request 1 holds the extent, request 2 has its first
    token and waits for an extent inside the prefill worker (TRANSFERRING).  Kill the prefill worker:
    request 2 is recomputed; 0 and 1 are untouched."""
    cfg = fake_disagg(n_seq_max=1, n_extents=1)
    lengths = [6000, 8, 8]  # request 0 decodes for seconds on the fake

    async def scenario():
        async with make_engine(cfg) as engine:
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                       for p, n in zip(PROMPTS[:3], lengths)]
            await streams[2].__anext__()  # its first token: now it waits for the only extent
            assert streams[2].lifecycle.state.value == "transferring" and len(engine.handoff.router.in_arena) == 1
            os.kill(engine.workers["prefill"].pid, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            return streams, ends

    streams, ends = run(scenario())
    for prompt, s, (events, _), n in zip(PROMPTS, streams, ends, lengths):
        assert events[-1].kind == "done" and FakeModel().detokenize(s.token_ids) == fake_text(prompt, n)
    assert [s.lifecycle.resumed_by for s in streams] == [[], [], ["recompute"]]


def test_a_request_whose_worker_keeps_dying_is_failed_after_max_resumes():
    from homepd.engine.recovery import MAX_RESUMES

    async def scenario():
        async with make_engine(fake_coloc()) as engine:
            stream = await engine.submit(PROMPTS[1], params=SamplingParams(max_tokens=10000, ignore_eos=True))
            handle, killed = engine.workers["colocated"], []
            for _ in range(MAX_RESUMES + 1):
                # why: the fake streams faster than the test reads, so a token read now may come from the worker
                # already killed; wait for its replacement, which holds the request from the moment it is ready
                async for _ in stream:
                    if handle.ready is not None and handle.pid not in killed:
                        break
                killed.append(handle.pid)
                os.kill(handle.pid, signal.SIGKILL)
            events, _ = await asyncio.wait_for(stream.collect(), timeout=60)
            again = await engine.submit(PROMPTS[0], params=SamplingParams(max_tokens=3))
            after, _ = await asyncio.wait_for(again.collect(), timeout=60)
            return stream, events, after

    stream, events, after = run(scenario())
    assert events[-1].kind == "error" and f"already resumed {MAX_RESUMES} times" in events[-1].error
    assert stream.lifecycle.n_resumes == MAX_RESUMES
    assert after[-1].kind == "done"  # the worker itself is fine


HANG_TIMEOUT_S = 2.0


@pytest.mark.parametrize("mode,victim", [("colocated", "colocated"), whole_box("disaggregated", "decode")])
def test_a_hung_worker_is_killed_restarted_and_its_requests_resumed(mode, victim):
    """SIGSTOP stands for a worker stuck in a step (a driver hang): alive, silent."""
    n_out = 3000
    cfg = (fake_coloc if mode == "colocated" else fake_disagg)(hang_timeout_s=HANG_TIMEOUT_S)

    async def scenario():
        async with make_engine(cfg) as engine:
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n_out, ignore_eos=True))
                       for p in PROMPTS[:2]]
            texts = {s.request_id: "" for s in streams}
            for s in streams:
                texts[s.request_id] += (await s.__anext__()).text + (await s.__anext__()).text
            pid = engine.workers[victim].pid
            os.kill(pid, signal.SIGSTOP)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            for s, (_, text) in zip(streams, ends):
                texts[s.request_id] += text
            return pid, streams, ends, engine.snapshot(), texts

    pid, streams, ends, snap, texts = run(scenario())
    (died,) = [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
    assert died.pid == pid and "hung" in died.cause and died.exitcode == -signal.SIGKILL
    for prompt, s, (events, _) in zip(PROMPTS, streams, ends):
        assert events[-1].kind == "done" and len(s.token_ids) == n_out and s.lifecycle.n_resumes == 1
        assert texts[s.request_id] == fake_text(prompt, n_out)


@pytest.mark.whole_box  # disaggregated
def test_a_worker_waiting_for_an_extent_is_not_mistaken_for_hung():
    """One extent, one decode sequence, a 2 s hang timeout: the prefill worker waits longer than that for an
    extent while request 0 decodes — it sends heartbeats and is left alone."""
    cfg = fake_disagg(n_ctx=65536, n_seq_max=1, n_extents=1, hang_timeout_s=HANG_TIMEOUT_S)
    lengths = [60000, 4, 4]  # request 0: far longer than the test lets it run

    async def scenario():
        async with make_engine(cfg) as engine:
            t0 = time.monotonic()
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                       for p, n in zip(PROMPTS[:3], lengths)]
            async for _ in streams[0]:  # request 0 decodes on until the others have waited past the timeout
                if time.monotonic() - t0 > HANG_TIMEOUT_S + 1.0:
                    break
            engine.cancel(streams[0].request_id)
            ends = await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams)), timeout=60)
            return streams, ends, engine.snapshot()

    streams, ends, snap = run(scenario())
    assert [events[-1].kind for events, _ in ends] == ["done"] * 3
    assert ends[0][0][-1].finish_reason == "cancelled"
    assert streams[2].lifecycle.kv_extent_wait_s > HANG_TIMEOUT_S  # it really waited longer than the timeout
    assert not [e for e in snap.worker_events if e.kind is WorkerEventKind.DIED]
