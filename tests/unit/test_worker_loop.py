"""The worker loop's failure handling, with a fake model and context (pure logic, no llama.cpp)."""
from __future__ import annotations

import os

import numpy as np

from homepd.core.protocol import RequestDone, StepReport, SubmitRequest
from homepd.core.sampling import SamplingParams
from homepd.core.protocol import WorkerSpec
from homepd.worker.loop import WorkerLoop

N_VOCAB = 16


class FakeModel:
    def is_eog(self, token):
        return False

    def token_to_piece(self, token):
        return f"<{token}>".encode()


class FakeCtx:
    n_ctx = 256

    def __init__(self):
        self.poison_rows: set[int] = set()
        self.fail_decode = False
        self.removed: list[int] = []

    def decode(self, tokens, positions, seq_ids, wants):
        if self.fail_decode:
            raise RuntimeError("llama_decode returned 1")
        self.n = len(tokens)

    def logits(self, row):
        out = np.zeros(N_VOCAB, dtype=np.float32)
        out[3] = 1.0
        if row in self.poison_rows:
            out[:] = np.nan
        return out

    def seq_rm(self, seq_id):
        self.removed.append(seq_id)


class Outbox:
    def __init__(self):
        self.sent = []
        self.r, self.w = os.pipe()

    def fileno(self):
        return self.r

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        os.close(self.r)
        os.close(self.w)


def loop_with(n_requests: int, temperature: float = 0.0):
    spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=256, n_seq_max=4, chunk=16, n_threads=1)
    ctx, out = FakeCtx(), Outbox()
    loop = WorkerLoop(spec, FakeModel(), ctx, out)
    for i in range(n_requests):
        loop.handle(SubmitRequest(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=5, temperature=temperature, seed=1)))
    return loop, ctx, out


def test_nan_logits_fail_only_that_request():
    loop, ctx, out = loop_with(2, temperature=0.7)
    loop.step(loop.scheduler.schedule())  # both prompts done: first tokens
    ctx.poison_rows = {0}                 # the next step's row 0 (r0's decode token) is NaN
    loop.step(loop.scheduler.schedule())
    failed = [m for m in out.sent if isinstance(m, RequestDone)]
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
    assert sorted(m.request_id for m in out.sent if isinstance(m, RequestDone) and m.reason == "error") == ["r0", "r1"]
    assert not loop.scheduler.has_work and loop.running
    ctx.fail_decode = False
    loop.handle(SubmitRequest("r2", (1, 2), SamplingParams(max_tokens=2)))
    loop.step(loop.scheduler.schedule())
    assert out.sent[-1].tokens[0].request_id == "r2"  # the worker still serves
    out.close()


def test_request_runs_to_max_tokens_with_text_and_length_reason():
    loop, ctx, out = loop_with(1)
    while loop.scheduler.has_work:
        loop.step(loop.scheduler.schedule())
    reports = [m for m in out.sent if isinstance(m, StepReport)]
    text = "".join(t.text for r in reports for t in r.tokens)
    assert text == "<3>" * 5
    (done,) = [d for r in reports for d in r.done]
    assert done.reason == "length" and len(reports) == 5
    out.close()
