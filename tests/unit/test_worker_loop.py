"""The worker loop's steps and failure handling, on the fake backend (pure logic, no llama.cpp)."""
from __future__ import annotations

import numpy as np

from homepd.core.kvpolicy import MAX_KV_PREEMPTIONS
from homepd.core.protocol import CancelRequest, KVPreempted, RequestDone, StepReport, SubmitRequest, WorkerSpec
from homepd.core.sampling import SamplingParams
from homepd.errors import WorkerError
from homepd.fakellm import FakeContext, FakeModel, next_token
from homepd.worker.loop import WorkerLoop
from homepd.worker.roles import ColocatedRole

from worker_fakes import Outbox


class FaultyContext(FakeContext):
    """The fake context, with NaN logits on chosen rows, a failing decode on demand, and seq_rm recorded."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.poison_rows: set[int] = set()
        self.fail_decode = False
        self.removed: list[int] = []

    def decode(self, tokens, positions, seq_ids, wants_logits):
        if self.fail_decode:
            raise WorkerError("llama_decode returned 1")
        super().decode(tokens, positions, seq_ids, wants_logits)

    def logits(self, row):
        return np.full(self.model.n_vocab, np.nan, dtype=np.float32) if row in self.poison_rows \
            else super().logits(row)

    def seq_rm(self, seq_id):
        self.removed.append(seq_id)
        super().seq_rm(seq_id)


def fake_greedy(prompt_ids, n_tokens: int) -> list[int]:
    """What the fake model generates after ``prompt_ids``, one sequence alone."""
    held, out = list(prompt_ids), []
    for _ in range(n_tokens):
        out.append(next_token(held))
        held.append(out[-1])
    return out


def loop_with(n_requests: int, temperature: float = 0.0, max_tokens: int = 5, prompt=lambda i: f"p{i}"):
    """A colocated loop holding ``n_requests`` submitted requests (3-token prompts unless told)."""
    spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=256, n_seq_max=4, chunk=16, n_threads=1,
                      backend="fake")
    model = FakeModel()
    ctx, out = FaultyContext(model, n_ctx=256, n_batch=spec.n_batch, n_seq_max=4, n_threads=1), Outbox()
    loop = WorkerLoop(spec, model, ctx, out)
    for i in range(n_requests):
        loop.handle(SubmitRequest(f"r{i}", tuple(model.tokenize(prompt(i))),
                                  SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1)))
    return loop, ctx, out


def run_to_end(loop: WorkerLoop) -> None:
    while loop.scheduler.has_work:
        loop.step(loop.scheduler.schedule())


def test_nan_logits_fail_only_that_request():
    loop, ctx, out = loop_with(2, temperature=0.7)
    loop.step(loop.scheduler.schedule())  # both prompts done: first tokens
    ctx.poison_rows = {0}                 # the next step's row 0 (r0's decode token) is NaN
    loop.step(loop.scheduler.schedule())
    failed = out.of_type(RequestDone)
    assert [(m.request_id, m.reason) for m in failed] == [("r0", "error")]
    assert "sampling failed" in failed[0].error
    report = out.sent[-1]
    assert isinstance(report, StepReport)
    assert [t.request_id for t in report.tokens] == ["r1"]
    assert report.step.decode_request_ids == ("r1",)
    assert [q.request_id for q in loop.scheduler.running] == ["r1"] and len(ctx.removed) == 1
    out.close()


def test_a_failed_decode_fails_the_step_not_the_worker():
    loop, ctx, out = loop_with(2)
    ctx.fail_decode = True
    loop.step(loop.scheduler.schedule())
    assert sorted(m.request_id for m in out.of_type(RequestDone) if m.reason == "error") == ["r0", "r1"]
    assert not loop.scheduler.has_work and loop.running
    assert sorted(ctx.removed) == [0, 1] and loop.scheduler.allocator.n_cells_reserved == 0
    ctx.fail_decode = False
    loop.handle(SubmitRequest("r2", (1, 2), SamplingParams(max_tokens=2)))
    loop.step(loop.scheduler.schedule())
    assert out.sent[-1].tokens[0].request_id == "r2"  # the worker still serves
    out.close()


def test_request_runs_to_max_tokens_with_text_and_length_reason():
    loop, ctx, out = loop_with(1)
    prompt_ids = loop.scheduler.waiting[0].prompt_ids
    run_to_end(loop)
    reports = out.of_type(StepReport)
    expected = fake_greedy(prompt_ids, 5)
    assert [t.token_id for r in reports for t in r.tokens] == expected
    assert "".join(t.text for r in reports for t in r.tokens) == FakeModel().detokenize(expected)
    (done,) = [d for r in reports for d in r.done]
    assert done.reason == "length" and len(reports) == 5
    out.close()


def test_batched_requests_each_get_what_they_would_alone():
    """Decodes and prompt chunks of four requests share steps; each request's tokens are its own."""
    loop, ctx, out = loop_with(4, max_tokens=12, prompt=lambda i: "x" * (4 + 9 * i))  # 5..32 tokens
    prompts = {q.request_id: q.prompt_ids for q in loop.scheduler.waiting}
    run_to_end(loop)
    got = {rid: [] for rid in prompts}
    for report in out.of_type(StepReport):
        for t in report.tokens:
            got[t.request_id].append(t.token_id)
    assert got == {rid: fake_greedy(p, 12) for rid, p in prompts.items()}
    assert loop.scheduler.allocator.n_cells_reserved == 0 and not ctx._seqs  # every sequence freed
    out.close()


def test_the_sampler_and_text_stream_live_on_the_sequence_and_leave_with_it():
    loop, ctx, out = loop_with(1, max_tokens=3)
    (seq,) = loop.scheduler.waiting
    assert seq.sampler is not None and seq.stream is not None and isinstance(loop.role, ColocatedRole)
    run_to_end(loop)
    assert seq.is_finished and seq.stream.released == FakeModel().detokenize(seq.output_ids)
    out.close()


def test_cancel_frees_the_sequence_and_reports_it():
    loop, ctx, out = loop_with(2)
    loop.step(loop.scheduler.schedule())
    loop.handle(CancelRequest("r0"))
    assert [(m.request_id, m.reason) for m in out.of_type(RequestDone)] == [("r0", "cancelled")]
    assert [q.request_id for q in loop.scheduler.running] == ["r1"] and len(ctx.removed) == 1
    loop.handle(CancelRequest("gone"))  # not held here: nothing to report
    assert len(out.of_type(RequestDone)) == 1
    out.close()


def full_context_loop(n_ctx: int = 96):
    """A colocated loop whose context three 80-token requests fill: a chat, a background job, a newer chat."""
    spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=n_ctx, n_seq_max=4, chunk=16, n_threads=1,
                      backend="fake")
    model = FakeModel()
    ctx, out = FaultyContext(model, n_ctx=n_ctx, n_batch=spec.n_batch, n_seq_max=4, n_threads=1), Outbox()
    loop = WorkerLoop(spec, model, ctx, out)
    for rid, klass in (("chat-old", "interactive"), ("batch", "background"), ("chat-new", "interactive")):
        loop.handle(SubmitRequest(rid, tuple(model.tokenize(rid)), SamplingParams(max_tokens=80, ignore_eos=True),
                                  request_class=klass))
    return loop, ctx, out


def test_a_full_context_preempts_background_first_and_recomputes_each_preempted_request_exactly():
    loop, ctx, out = full_context_loop()
    prompts = {q.request_id: q.prompt_ids for q in loop.scheduler.waiting}
    run_to_end(loop)  # the fake context refuses a batch past n_ctx, so a missed reservation fails a request
    got = {rid: [] for rid in prompts}
    for report in out.of_type(StepReport):
        for t in report.tokens:
            got[t.request_id].append(t.token_id)
    ends = [d for r in out.of_type(StepReport) for d in r.done] + out.of_type(RequestDone)
    assert sorted((d.request_id, d.reason, d.kv_full) for d in ends) == [
        ("batch", "length", False), ("chat-new", "length", False), ("chat-old", "length", False)]
    preempted = [p.request_id for p in out.of_type(KVPreempted)]
    assert preempted[0] == "batch" and "chat-new" in preempted and "chat-old" not in preempted
    # preempted and recomputed (output prefilled again as prompt, same sampler): the same tokens as alone
    assert got == {rid: fake_greedy(p, 80) for rid, p in prompts.items()}
    assert loop.scheduler.allocator.n_cells_reserved == 0 and not ctx._seqs  # every sequence's KV dropped
    out.close()


def test_a_request_preempted_too_often_ends_with_length_marked_kv_full():
    loop, ctx, out = full_context_loop()
    loop.step(loop.scheduler.schedule())
    loop.step(loop.scheduler.schedule())  # all three decode
    loop.scheduler.find("batch").n_preemptions = MAX_KV_PREEMPTIONS
    run_to_end(loop)
    ends = {d.request_id: d for d in [d for r in out.of_type(StepReport) for d in r.done] + out.of_type(RequestDone)}
    assert ends["batch"].reason == "length" and ends["batch"].kv_full
    n_streamed = sum(1 for r in out.of_type(StepReport) for t in r.tokens if t.request_id == "batch")
    assert 0 < n_streamed < 80 and not ends["chat-old"].kv_full and not ends["chat-new"].kv_full
    assert loop.scheduler.allocator.n_cells_reserved == 0 and not ctx._seqs
    out.close()
