"""Request classes reach the engine: each request carries its class and the snapshot counts them (fake backend:
real worker processes, no model).  A class is parsed once, at the HTTP edge (test_serve_api, test_serve_units):
the engine takes a ``RequestClass``, and refuses a plain string as the programming error it is."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import make_engine, run
from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.core.admission import AdmissionRejected
from homepd.core.terms import RequestClass
from homepd.errors import RequestError


def test_each_request_carries_its_class_and_the_snapshot_counts_them():
    async def scenario():
        async with make_engine(EngineConfig(backend="fake", n_ctx=2048)) as engine:
            long = SamplingParams(max_tokens=500, ignore_eos=True)
            streams = [await engine.submit("chat", params=long),
                       await engine.submit("summary", params=long, request_class=RequestClass.BACKGROUND),
                       await engine.submit("voice", params=long, request_class=RequestClass.INTERACTIVE)]
            counts = engine.snapshot().requests_by_class
            with pytest.raises(TypeError, match="RequestClass"):
                await engine.submit("x", request_class="background")
            for s in streams:
                engine.cancel(s.request_id)
            await asyncio.gather(*(s.collect() for s in streams))
            return [s.lifecycle for s in streams], counts, engine.snapshot().requests_by_class

    lcs, counts, after = run(scenario())
    assert [lc.request_class for lc in lcs] == ["interactive", "background", "interactive"]
    assert counts == {"interactive": 2, "background": 1} and after == {}
    assert lcs[1].to_dict()["request_class"] == "background"


def test_admission_rejects_early_once_it_can_predict_and_says_when_to_retry():
    """With a TTFT budget no prediction can meet, requests are admitted while the worker's speed is unmeasured,
    then refused at submit with AdmissionRejected (a RequestError) carrying retry_after_s; nothing reaches a
    worker, and the gate counts both decisions."""
    async def scenario():
        config = EngineConfig(backend="fake", n_ctx=2048, admission=True, ttft_budget_ms=1e-6, chunk=8,
                              adaptive_chunk=False)
        async with make_engine(config) as engine:
            admitted = 0
            while engine.gate.estimate("colocated") is None:  # measure: long prompts, several chunks each
                stream = await engine.submit("word " * 40, params=SamplingParams(max_tokens=2))
                await stream.collect()
                admitted += 1
            with pytest.raises(AdmissionRejected) as caught:
                await engine.submit("one more", params=SamplingParams(max_tokens=2))
            in_flight = sum(len(h.in_flight) for h in engine.workers.values())
            return admitted, caught.value, engine.snapshot().admission, in_flight

    admitted, exc, adm, in_flight = run(scenario())
    assert isinstance(exc, RequestError) and exc.retry_after_s >= 1.0 and exc.request_class == "interactive"
    assert "predicted TTFT" in str(exc) and in_flight == 0
    interactive = next(c for c in adm.classes if c.request_class == "interactive")
    assert (interactive.admitted, interactive.rejected) == (admitted, 1)
    assert adm.admission and 0 < adm.chunk_by_worker["colocated"] <= 8  # fixed chunk: 8 less its decodes


def test_background_is_deferred_behind_queued_interactive_work_and_predictions_are_scored():
    """A long background document is running when a chat arrives: the chat's prompt overtakes it (its
    prefill ends first, though it arrived later), and background work arriving meanwhile is deferred."""
    async def scenario():
        config = EngineConfig(backend="fake", n_ctx=8192, chunk=8, n_seq_max=4)
        async with make_engine(config) as engine:
            warm = [await engine.submit("word " * 40, params=SamplingParams(max_tokens=2)) for _ in range(3)]
            await asyncio.gather(*(s.collect() for s in warm))
            assert engine.gate.estimate("colocated") is not None
            # why a difference: a warm-up submitted after the fake's first steps may already get a prediction
            n_before = engine.snapshot().admission.n_predictions
            doc = await engine.submit("doc " * 300, params=SamplingParams(max_tokens=4), request_class=RequestClass.BACKGROUND)
            # why not the warm-up's text, and why 200 tokens: a chat the prefix cache holds is one step of work, and
            # a short one five; either could be decoding already when the late background request arrives (nothing
            # queued: admitted, 1 run in 10 and 1 in 15); 25 steps at chunk 8 outlast the next submit
            chat = await engine.submit("talk " * 200, params=SamplingParams(max_tokens=4))
            late = await engine.submit("doc " * 10, params=SamplingParams(max_tokens=4), request_class=RequestClass.BACKGROUND)
            snap = engine.snapshot().admission
            await asyncio.gather(doc.collect(), chat.collect(), late.collect())
            return [s.lifecycle for s in (doc, chat, late)], snap, engine.snapshot().admission, n_before

    (doc, chat, late), during, after, n_before = run(scenario())
    assert (doc.admission, chat.admission, late.admission) == ("admit", "admit", "defer")
    queued = {c.request_class: c for c in during.classes}
    assert queued["interactive"].queued_requests == 1 and queued["interactive"].queued_prompt_tokens > 0
    assert queued["background"].deferred == 1 and queued["background"].queued_requests == 2
    assert chat.prefill_end_s < doc.prefill_end_s          # interactive overtook the running background prompt
    assert all(lc.state.value == "finished" for lc in (doc, chat, late))  # background still completes
    assert after.n_predictions - n_before == 3 and after.ttft_error_mean_ms is not None


@pytest.mark.whole_box  # disaggregated
def test_disaggregated_routes_a_short_prompt_to_the_decode_worker_when_the_prefill_queue_is_long():
    """Learned routing: once the prefill worker's speed is measured, a long prompt reaching an idle prefill worker
    goes there (and through a KV handoff), and a short prompt arriving behind queued long ones is prefilled on
    the decode worker itself (no handoff)."""
    async def scenario():
        config = EngineConfig(backend="fake", mode="disaggregated", n_ctx=4096, chunk=16, n_seq_max=4,
                              prefill_threads=1, decode_threads=1)
        async with make_engine(config) as engine:
            while engine.gate.estimate("prefill") is None:  # measure the prefill worker
                stream = await engine.submit("word " * 40, params=SamplingParams(max_tokens=2))
                await stream.collect()
            longs = [await engine.submit("doc " * 150, params=SamplingParams(max_tokens=2)) for _ in range(3)]
            short = await engine.submit("hi", params=SamplingParams(max_tokens=2))
            await asyncio.gather(*(s.collect() for s in [*longs, short]))
            return [s.lifecycle for s in longs], short.lifecycle, engine.snapshot().admission

    longs, short, adm = run(scenario())
    assert longs[0].kv_bytes                        # the first long prompt: the idle prefill worker, then a handoff
    assert short.kv_bytes is None and short.state.value == "finished"   # prefilled where it decodes
    assert adm.routed_local >= 1 and adm.routed_remote >= 1 and adm.route_threshold_tokens is not None
