"""FinishReason and RequestClass travel as enums from the worker to the records, and print and serialise as the
strings they replaced (fake backend, no llama.cpp)."""
from __future__ import annotations

import json

import pytest

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle, RequestState, end_state
from homepd.core.protocol import CancelRequest, KVHandoff, RequestDone, StepReport, SubmitRequest, WorkerSpec
from homepd.core.records import EngineSnapshot, FinishReason, to_plain
from homepd.core.sampling import SamplingParams
from homepd.fakellm import FakeContext, FakeModel
from homepd.worker.loop import WorkerLoop

from worker_fakes import Outbox


def test_the_worker_reports_finish_reasons_as_enums_and_its_sequences_carry_their_class():
    model, out = FakeModel(), Outbox()
    worker_spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=256, n_seq_max=4, chunk=16, n_threads=1,
                             backend="fake")
    ctx = FakeContext(model, n_ctx=256, n_batch=worker_spec.n_batch, n_seq_max=4, n_threads=1)
    loop = WorkerLoop(worker_spec, model, ctx, out)
    loop.handle(SubmitRequest("long", (1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True),
                              request_class="background"))
    loop.handle(SubmitRequest("gone", (1, 2, 3), SamplingParams(max_tokens=50)))
    assert [s.request_class for s in loop.scheduler.waiting] == [RequestClass.BACKGROUND, RequestClass.INTERACTIVE]
    loop.step(loop.scheduler.schedule())
    loop.handle(CancelRequest("gone"))
    while loop.scheduler.has_work:
        loop.step(loop.scheduler.schedule())
    done = out.of_type(RequestDone) + [d for r in out.of_type(StepReport) for d in r.done]
    assert {d.request_id: d.reason for d in done} == {"gone": FinishReason.CANCELLED, "long": FinishReason.LENGTH}
    assert all(type(d.reason) is FinishReason for d in done)
    out.close()


def test_each_finish_reason_leaves_the_request_in_its_state():
    assert [end_state(r) for r in FinishReason] == [RequestState.FINISHED, RequestState.FINISHED,
                                                    RequestState.CANCELLED, RequestState.FAILED]


def test_a_typo_fails_where_the_message_is_made_instead_of_counting_as_nothing():
    with pytest.raises(ValueError):
        RequestDone("r", "stopped", 0.0)
    with pytest.raises(ValueError):
        SubmitRequest("r", (1,), SamplingParams(), request_class="backgroud")
    handoff = KVHandoff("r", 0, (1,), (), SamplingParams(), None, 0, 0, 0.0, 0.0, 0.0,
                        request_class="background")
    assert handoff.request_class is RequestClass.BACKGROUND


def test_records_print_and_serialise_as_the_strings_they_replaced():
    lc = Lifecycle("r", 0.0, request_class="background")
    lc.finish_reason = FinishReason.LENGTH
    assert lc.request_class is RequestClass.BACKGROUND
    as_json = json.dumps(lc.to_dict())
    assert '"request_class": "background"' in as_json and '"finish_reason": "length"' in as_json
    assert f"[{lc.finish_reason}] {lc.request_class}" == "[length] background"
    snap = EngineSnapshot(mode="colocated", model=None, n_ctx=1, chunk=None, workers=(), kv_arena=None,
                          requests={}, n_steps=0, worker_events=(),
                          requests_by_class={RequestClass.INTERACTIVE: 2})
    assert json.dumps(to_plain(snap)["requests_by_class"]) == '{"interactive": 2}'
    assert json.dumps({"finish_reason": FinishReason.STOP}) == '{"finish_reason": "stop"}'
