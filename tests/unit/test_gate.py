"""One step-time model, owned by the worker: the worker publishes its estimate with each step, the admission
gate predicts from that estimate, and advise picks the chunk the serving policy would give (pure, fake backend)."""
from __future__ import annotations

from dataclasses import replace
from itertools import groupby

import pytest

from homepd.advise.campaign.run import MIN_PREDICTED_CHUNK, predicted_chunk
from homepd.config import EngineConfig
from homepd.core.admission import Verdict
from homepd.core.terms import RequestClass, StepEstimate
from homepd.core.protocol import StepRecord, StepReport, SubmitRequest, WorkerSpec
from homepd.core.sampling import SamplingParams
from homepd.core.sequence import Sequence
from homepd.core.steppolicy import StepPolicy
from homepd.engine.gate import MIN_PROMPT_STEPS, AdmissionGate, WorkerLoad
from homepd.fakellm import FakeContext, FakeModel
from homepd.worker.loop import WorkerLoop

from worker_fakes import Outbox

I = RequestClass.INTERACTIVE
# 10 ms a step, 2 ms a prompt token, 5 ms a decode, no attention term, no error: easy to price by hand
EST = StepEstimate(base_ms=10.0, ms_per_prompt_token=2.0, ms_per_decode_token=5.0, ms_per_kv_ktoken=0.0,
                   n_steps=20, error_ms=0.0, n_prompt_steps=MIN_PROMPT_STEPS)


def spec(itl_budget_ms=None, chunk=64):
    return WorkerSpec(role="colocated", model_path="fake", n_ctx=4096, n_seq_max=4, chunk=chunk, n_threads=1,
                      backend="fake", itl_budget_ms=itl_budget_ms)


def report(estimate, n_prompt=8, budget=64):
    step = StepRecord("colocated", 1, 0.0, 0.05, (), (("r", n_prompt),), budget=budget)
    return StepReport(step=step, estimate=estimate)


def load(queued_interactive, n_decode=0, n_interactive=0):
    return WorkerLoad({I: queued_interactive}, {I: 1}, n_decode, n_interactive)


def observed(*reports):
    gate = AdmissionGate(EngineConfig(backend="fake", admission=True))
    for r in reports:
        gate.observe("colocated", r.step, r.estimate)  # what the controller does with each StepReport
    return gate


def test_the_gate_predicts_ttft_from_the_estimate_in_the_step_report():
    gate = observed(report(EST))
    # fixed chunk 64, nothing decoding: 64-token steps of 10 + 2*64 = 138 ms; 100 queued + 50 own tokens
    # take 150 * 138/64 ms, then one step without prompt tokens (10 ms)
    d = gate.decide(I, 50, "colocated", spec(), load(100))
    assert d.predicted_ttft_ms == pytest.approx(150 * 138 / 64 + 10)
    # adaptive, two interactive streams decoding: the step may take 85 ms of the 100 ms ITL, 10 + 2*5 of it
    # fixed, so (85 - 20) / 2 = 32 prompt tokens a step of 10 + 2*32 + 10 = 84 ms; then one 20 ms step
    d = gate.decide(I, 50, "colocated", spec(itl_budget_ms=100.0), load(100, n_decode=2, n_interactive=2))
    assert d.predicted_ttft_ms == pytest.approx(150 * 84 / 32 + 20)
    assert d.verdict is Verdict.ADMIT
    assert gate.snapshot(load(0), {}).prefill_tok_s_by_worker == {"colocated": round(64 / 138 * 1e3, 1)}


def test_a_prefill_speed_is_trusted_only_after_a_few_prompt_steps():
    early = StepEstimate(**{**EST.__dict__, "n_prompt_steps": MIN_PROMPT_STEPS - 1})
    gate = observed(report(None), report(early))
    assert gate.estimate("colocated") is None
    assert gate.decide(I, 50, "colocated", spec(), load(100)) is None  # unmeasured: admitted, nothing predicted
    gate.observe("colocated", report(EST).step, EST)
    assert gate.estimate("colocated") == EST


def test_a_restarted_workers_untrusted_estimate_does_not_replace_its_predecessors():
    fresh = StepEstimate(**{**EST.__dict__, "base_ms": 99.0, "n_steps": 8, "n_prompt_steps": 1})
    gate = observed(report(EST), report(None), report(fresh))
    assert gate.estimate("colocated") == EST
    newer = StepEstimate(**{**EST.__dict__, "base_ms": 12.0})
    gate.observe("colocated", report(newer).step, newer)
    assert gate.estimate("colocated") == newer


def test_the_worker_publishes_the_model_its_policy_budgets_with_and_the_gate_reads_it():
    worker_spec = spec()
    model, out = FakeModel(), Outbox()
    ctx = FakeContext(model, n_ctx=4096, n_batch=worker_spec.n_batch, n_seq_max=4, n_threads=1)
    loop = WorkerLoop(worker_spec, model, ctx, out)
    for i in range(3):
        loop.handle(SubmitRequest(f"r{i}", tuple(model.tokenize("word " * 100)), SamplingParams(max_tokens=6)))
    gate = AdmissionGate(EngineConfig(backend="fake"))
    while loop.scheduler.has_work:
        loop.step(loop.scheduler.schedule())
        sent = out.of_type(StepReport)[-1]
        gate.observe("colocated", sent.step, sent.estimate)
        assert sent.estimate == loop.step_model.estimate()
    reports = out.of_type(StepReport)
    assert reports[0].estimate is None and reports[-1].estimate is not None
    assert reports[-1].estimate.n_prompt_steps == sum(1 for r in reports if r.step.n_prompt_tokens)
    assert gate.estimate("colocated") == reports[-1].estimate
    out.close()


def test_prompts_waiting_for_a_sequence_id_are_counted_in_prompt_seconds_and_named_in_metrics_and_the_app():
    from homepd.serve.metrics import _admission_metrics
    from homepd.tui.derive import admission_lines

    worker_spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=4096, n_seq_max=1, chunk=64, n_threads=1,
                             backend="fake")
    model, out = FakeModel(), Outbox()
    ctx = FakeContext(model, n_ctx=4096, n_batch=worker_spec.n_batch, n_seq_max=1, n_threads=1)
    loop = WorkerLoop(worker_spec, model, ctx, out)
    for i in range(3):  # one id: r1 and r2 wait for r0's, then r2 for r1's
        loop.handle(SubmitRequest(f"r{i}", tuple(model.tokenize("word " * 20)), SamplingParams(max_tokens=4)))
    gate = AdmissionGate(EngineConfig(backend="fake"))
    while loop.scheduler.has_work:
        loop.step(loop.scheduler.schedule())
        gate.observe("colocated", out.of_type(StepReport)[-1].step, None)
    steps = [r.step for r in out.of_type(StepReport)]
    out.close()
    assert [n for n, _ in groupby(s.n_waiting_for_id for s in steps)] == [2, 1, 0]
    waited = sum(s.n_waiting_for_id * (s.t_end_s - s.t_start_s) for s in steps)
    snap = gate.snapshot(WorkerLoad({}, {}, 0, 0), {})
    assert snap.id_wait_s_by_worker == {"colocated": pytest.approx(waited)} and waited > 0
    metrics = {f.name: f for f in _admission_metrics(snap)}
    assert [(s.labels["role"], s.value) for s in metrics["homepd_prompt_id_wait_seconds"].samples
            if s.name.endswith("_total")] == [("colocated", pytest.approx(waited))]
    assert "prompts waited 2.3 s for a sequence id" in \
        admission_lines(replace(snap, id_wait_s_by_worker={"colocated": 2.34}))["budgets"]
    fresh = AdmissionGate(EngineConfig(backend="fake"))
    assert fresh.snapshot(WorkerLoad({}, {}, 0, 0), {}).id_wait_s_by_worker == {}  # no worker has stepped yet
    fresh.observe("colocated", steps[-1], None)  # a step that left nothing waiting: the series is there, at 0
    none_waited = fresh.snapshot(WorkerLoad({}, {}, 0, 0), {})
    assert none_waited.id_wait_s_by_worker == {"colocated": 0.0}
    assert [(s.labels["role"], s.value) for s in {f.name: f for f in _admission_metrics(none_waited)}[
        "homepd_prompt_id_wait_seconds"].samples if s.name.endswith("_total")] == [("colocated", 0.0)]
    assert "sequence id" not in admission_lines(none_waited)["budgets"]


def decoding_steps(n_decode, kv_in_use, n=9):
    return [StepRecord("colocated", i, 0.0, 0.01, tuple(f"d{j}" for j in range(n_decode)), (), kv_in_use=kv_in_use)
            for i in range(n)]


@pytest.mark.parametrize("per_prompt_ms, per_kv_ms, expected", [(2.0, 0.0, 32), (1.5, 0.0, 32), (1.0, 1.0, 32)])
def test_advise_predicts_the_chunk_the_serving_policy_gives_for_the_same_estimate(per_prompt_ms, per_kv_ms,
                                                                                    expected):
    est = StepEstimate(**{**EST.__dict__, "ms_per_prompt_token": per_prompt_ms, "ms_per_kv_ktoken": per_kv_ms})
    steps = decoding_steps(1, 0, n=3) + decoding_steps(2, 500) + decoding_steps(3, 900, n=3)  # medians: 2, 500
    policy = StepPolicy(chunk=None, n_batch=4096, itl_budget_ms=100.0, estimate=lambda: est)
    served = policy.budget([Sequence(f"d{j}", [1]) for j in range(2)], kv_in_use=500)
    chunk = predicted_chunk(est, steps, itl_target_ms=100.0)
    # the serving budget, rounded down to a power of two: 32 exactly, 43 and 42 (with the attention term)
    assert chunk == expected == 1 << (served.bit_length() - 1)
    assert served == {(2.0, 0.0): 32, (1.5, 0.0): 43, (1.0, 1.0): 42}[(per_prompt_ms, per_kv_ms)]


def test_advise_predicts_nothing_without_an_estimate_and_at_least_its_smallest_chunk():
    assert predicted_chunk(None, decoding_steps(2, 0), 100.0) is None
    slow = StepEstimate(**{**EST.__dict__, "base_ms": 200.0})  # even an empty step misses the target
    assert predicted_chunk(slow, decoding_steps(2, 0), 100.0) == MIN_PREDICTED_CHUNK


def test_the_gate_predicts_the_chunk_the_worker_will_run_for_the_same_state():
    """One budget rule (StepPolicy.of_spec): the admission gate's prompt-per-step for a worker equals the one
    that worker's loop gives the same decodes, KV in use, ITL budget and idle cap."""
    from homepd.config import EngineConfig
    from homepd.core.lifecycle import Lifecycle
    from homepd.core.protocol import WorkerSpec
    from homepd.core.sampling import SamplingParams
    from homepd.core.sequence import Sequence
    from homepd.core.steppolicy import StepPolicy
    from homepd.core.terms import StepEstimate
    from homepd.engine.gate import AdmissionGate, load_of

    est = StepEstimate(base_ms=12.0, ms_per_prompt_token=1.5, ms_per_decode_token=4.0, ms_per_kv_ktoken=0.02,
                       n_steps=40, error_ms=1.0, n_prompt_steps=30)
    spec = WorkerSpec(role="colocated", model_path="fake://model", n_ctx=4096, n_seq_max=8, chunk=256, n_threads=1,
                      itl_budget_ms=100.0, idle_step_ms=500.0)
    gate = AdmissionGate(EngineConfig(backend="fake"))
    gate.estimates["colocated"] = est
    for n_interactive, n_background in ((0, 0), (2, 0), (0, 3), (3, 2)):
        decoding = [Sequence(f"i{k}", list(range(300)), SamplingParams(max_tokens=64), output_ids=[5] * 10,
                             n_prefilled=300, request_class="interactive") for k in range(n_interactive)]
        decoding += [Sequence(f"b{k}", list(range(300)), SamplingParams(max_tokens=64), output_ids=[5] * 10,
                              n_prefilled=300, request_class="background") for k in range(n_background)]
        kv_in_use = sum(s.n_kv_tokens for s in decoding)
        worker = StepPolicy.of_spec(spec, lambda: est).budget(decoding, kv_in_use)
        lifecycles = []
        for s in decoding:
            lc = Lifecycle(s.request_id, 0.0, n_prompt_tokens=300, request_class=s.request_class)
            for t in range(10):
                lc.add_token(float(t))
            lifecycles.append(lc)
        load = load_of(lifecycles)
        assert load.kv_in_use == kv_in_use
        rate, rest_ms = gate.prefill_rate("colocated", spec, load.n_decode, load.n_interactive_decode, load.kv_in_use)
        assert rate == pytest.approx(est.prefill_tok_s(len(decoding), worker)), (n_interactive, n_background)


def test_with_streams_the_gate_prices_a_step_at_the_depth_of_the_sequences_holding_kv():

    from homepd.core.lifecycle import Lifecycle
    from homepd.core.protocol import WorkerSpec
    from homepd.engine.gate import load_of

    spec = WorkerSpec(role="colocated", model_path="fake://model", n_ctx=4096, n_seq_max=4, chunk=256, n_threads=1)
    lifecycles = []
    for k, n_prompt in enumerate((300, 500)):
        lc = Lifecycle(f"d{k}", 0.0, n_prompt_tokens=n_prompt)
        lc.add_token(0.0)
        lifecycles.append(lc)
    queued = Lifecycle("q", 0.0, n_prompt_tokens=900)  # waiting for its turn: no KV held
    load = load_of([*lifecycles, queued])
    assert load.kv_in_use == 800 and load.n_seqs == 2
    assert load.kv_attended(spec) == 800  # one pool: every cell in use
    assert load.kv_attended(replace(spec, kv_unified=False)) == 400  # streams: their mean
    # with 600 cells of cached prefixes beside them: one pool without flash attention attends over those too, as
    # the worker's own scheduler counts them; with flash attention (masked cells skipped) or streams, not
    cached = load_of([*lifecycles, queued], idle_cells=600)
    assert cached.kv_attended(spec) == 1400
    assert cached.kv_attended(replace(spec, flash_attn=True)) == 800
    assert cached.kv_attended(replace(spec, kv_unified=False)) == 400
    # its latest step reported a used range of 2,304 cells (holes below its sequences): one pool without flash
    # attention is priced by it, as the worker's scheduler priced that step; the counted cells stay the floor
    ranged = load_of([*lifecycles, queued], idle_cells=600, kv_range=2304)
    assert ranged.kv_attended(spec) == 2304
    assert load_of([*lifecycles, queued], idle_cells=600, kv_range=512).kv_attended(spec) == 1400
    assert ranged.kv_attended(replace(spec, flash_attn=True)) == 800
    assert ranged.kv_attended(replace(spec, kv_unified=False)) == 400
