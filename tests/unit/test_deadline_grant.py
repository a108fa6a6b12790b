"""The deadline rule (homepd.core.steppolicy.deadline_grant, lost_grant): a step past the ITL budget is granted to a
prompt's TTFT deadline only when it keeps that deadline and puts no more streams out of their gap budget than the
one request it keeps, never above the gap ceiling, and never while the deadline is far.  Pure: constructed step
models and queues, no model, no clock."""
from __future__ import annotations

import math
import random

import pytest

from homepd.core.protocol import StepRecord
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.core.terms import StepEstimate
from homepd.core.steppolicy import STEP_SHARE_OF_ITL, StepPolicy, deadline_grant, lost_grant

# a 2-core CPU's step: 12 ms, 4.5 ms a prompt token, 2 ms a decode (no KV term: the arithmetic stays readable)
EST = StepEstimate(base_ms=12.0, ms_per_prompt_token=4.5, ms_per_decode_token=2.0, ms_per_kv_ktoken=0.0,
                   n_steps=100, error_ms=0.0, n_prompt_steps=50)
ITL_MS, CEILING_MS = 100.0, 300.0
ITL_CHUNK = EST.chunk_for_itl(ITL_MS * STEP_SHARE_OF_ITL, 3)  # 14 tokens beside 3 decodes: 81 ms steps


def prompt(rid="doc", n=300, deadline=None, klass="interactive"):
    return Sequence(request_id=rid, prompt_ids=list(range(100, 100 + n)), params=SamplingParams(max_tokens=8),
                    request_class=klass, deadline_s=deadline)


def streams(n=3, broken=True, klass="interactive", tokens_left=31):
    out = []
    for i in range(n):
        s = Sequence(request_id=f"chat-{i}", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=1 + tokens_left),
                     request_class=klass, seq_id=i, n_prefilled=3, output_ids=[7], gap_broken=broken)
        out.append(s)
    return out


def done_s(b: int, n_left: int = 300, n_decode: int = 3) -> float:
    """When a prompt of n_left tokens completes at b tokens a step, from t=0."""
    return math.ceil(n_left / b) * EST.predict_ms(b, n_decode) / 1e3


def grant(deadline_s, decode=None, head=None, budget=ITL_CHUNK, ceiling_ms=CEILING_MS):
    head = head or prompt(deadline=deadline_s)
    return deadline_grant(EST, [head], streams() if decode is None else decode, 0.0, ITL_MS, ceiling_ms,
                          budget, 512)


def test_the_itl_budget_s_steps_would_miss_the_deadline_that_a_ceiling_step_keeps():
    # the scene the rule is for (the numbers the tests below stand on)
    assert ITL_CHUNK == 14 and done_s(ITL_CHUNK) == pytest.approx(1.782)
    assert EST.predict_ms(62, 3) <= CEILING_MS < EST.predict_ms(63, 3) and done_s(62) == pytest.approx(1.485)


def test_a_deadline_that_needs_it_gets_a_step_at_the_ceiling():
    g = grant(1.5)
    assert g is not None and g.request_id == "doc"
    assert g.budget == 62 and g.step_ms == pytest.approx(EST.predict_ms(62, 3)) and g.step_ms <= CEILING_MS
    assert done_s(g.budget) <= 1.5  # it keeps the deadline, and its first token comes soonest


def test_never_while_the_itl_budget_still_keeps_the_deadline():
    assert grant(1.8) is None and grant(60.0) is None
    assert grant(1.8, decode=streams(3, broken=False)) is None


def test_never_beside_more_than_one_stream_still_within_its_gap_budget():
    # 1.6 s: missed at 14 a step, kept at the ceiling.  The grant keeps one request within both budgets (the prompt):
    # beside streams that already missed a gap it costs none, beside one that has not the count is even (the
    # prompt's first token the gain), beside two it loses one
    assert done_s(ITL_CHUNK) > 1.6 >= done_s(62)
    assert grant(1.6, decode=streams(3, broken=True)).budget == 62
    one_keeper = streams(3, broken=True)
    one_keeper[1].gap_broken = False
    assert grant(1.6, decode=one_keeper).budget == 62
    two_keepers = streams(3, broken=True)
    two_keepers[0].gap_broken = two_keepers[1].gap_broken = False
    assert grant(1.6, decode=two_keepers) is None
    assert grant(1.6, decode=streams(3, broken=False)) is None
    # a background stream has no gap budget to keep
    assert grant(1.6, decode=[*one_keeper, *streams(2, broken=False, klass="background")]) is not None


def test_refused_then_granted_once_a_stream_within_its_budget_has_ended():
    # the prompt goes on in ITL-sized steps beside two streams within their budget; one step later one of them has
    # ended and the ceiling still keeps the deadline (1.52 s, 286 tokens left): granted then
    finishing = streams(3, broken=True)
    finishing[0].gap_broken = finishing[1].gap_broken = False
    assert grant(1.6, decode=finishing) is None
    later = prompt(deadline=1.52)
    later.seq_id, later.n_prefilled = 9, ITL_CHUNK
    assert 0.081 + done_s(62, 300 - 2 * ITL_CHUNK) > 1.52 >= done_s(62, 300 - ITL_CHUNK)
    assert grant(1.52, head=later, decode=finishing[1:]) is not None


def test_never_for_a_prompt_that_not_even_the_ceiling_can_keep():
    assert done_s(62) > 1.4 and grant(1.4) is None
    assert grant(1.5, ceiling_ms=ITL_MS) is None  # a ceiling of one ITL budget grants nothing


def test_only_interactive_streams_and_prompts_count():
    assert grant(1.5, decode=streams(3, broken=False, klass="background")) is None  # the step is not ITL-bound
    assert grant(1.5, head=prompt(deadline=1.5, klass="background")) is None
    assert grant(1.5, head=prompt(deadline=None)) is None


def test_a_waiting_prompt_s_expected_cached_prefix_is_not_work():
    cached = prompt(deadline=1.5)
    cached.n_expected_reuse = 290  # a follow-up turn: 10 tokens to compute, this step does them
    assert grant(1.5, head=cached) is None


def test_any_grant_is_above_the_itl_budget_within_the_ceiling_and_keeps_the_deadline():
    rng = random.Random(7)
    n_granted = 0
    for _ in range(2000):
        n_decode, n_prompt = rng.randint(1, 6), rng.randint(20, 900)
        ceiling = rng.choice([150.0, 200.0, 300.0, 500.0])
        budget = EST.chunk_for_itl(ITL_MS * STEP_SHARE_OF_ITL, n_decode, lo=4)
        deadline = rng.uniform(0.3, 1.2) * done_s(budget, n_prompt, n_decode)  # about when it would be done
        g = deadline_grant(EST, [prompt(n=n_prompt, deadline=deadline)], streams(n_decode), 0.0, ITL_MS, ceiling,
                           budget, 512)
        if n_decode >= 2:  # at least two streams still within their gap budget: a grant would lose one on balance
            n_broken = rng.randint(0, n_decode - 2)
            keepers = [*streams(n_broken, broken=True), *streams(n_decode - n_broken, broken=False)]
            beside = deadline_grant(EST, [prompt(n=n_prompt, deadline=deadline)], keepers, 0.0, ITL_MS, ceiling,
                                    budget, 512)
            assert beside is None or beside.step_ms <= ITL_MS * STEP_SHARE_OF_ITL  # breaks no gap
        if g is None:
            continue
        n_granted += 1
        assert budget < g.budget and g.step_ms <= ceiling
        assert done_s(budget, n_prompt, n_decode) > deadline >= done_s(g.budget, n_prompt, n_decode)
    assert n_granted > 50


def test_the_order_judges_a_prompt_late_at_the_pace_it_will_get():
    # a document a ceiling step keeps (1.485 s of 1.6) and that the ITL budget's steps make late (1.782 s): beside
    # at most one stream still within its gap budget a grant can keep it, so it goes first by its deadline; beside
    # two no grant will, so it is late and set after the turn it would otherwise delay
    policy = StepPolicy(chunk=512, n_batch=512, itl_budget_ms=ITL_MS, estimate=lambda: EST, gap_ceiling_ms=CEILING_MS)
    doc, turn = prompt(rid="doc", n=300, deadline=1.6), prompt(rid="turn", n=20, deadline=3.0)
    ids = lambda keepers: [s.request_id for s in policy.order([doc, turn], 0.0, 3, 0, ITL_CHUNK,  # noqa: E731
                                                               n_gap_keepers=keepers)]
    assert ids(0) == ids(1) == ["doc", "turn"] and ids(2) == ["turn", "doc"]


def scheduler(gap_ceiling_ms):
    policy = StepPolicy(chunk=512, n_batch=512, itl_budget_ms=ITL_MS, estimate=lambda: EST,
                        gap_ceiling_ms=gap_ceiling_ms)
    sched = Scheduler(n_seq_max=8, n_ctx=4096, n_batch=512, chunk=512, policy=policy)
    return sched


def run_streams(sched, n=3, max_tokens=64):
    for s in streams(n, broken=False):
        fresh = Sequence(request_id=s.request_id, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens))
        sched.add(fresh)
    plan = sched.schedule(0.0)
    sched.postprocess(plan, {s.seq.request_id: 7 for s in plan.prefill}, t_s=0.0)
    return plan


def test_the_scheduler_steps_with_the_grant_and_every_stream_still_takes_its_token():
    sched = scheduler(CEILING_MS)
    run_streams(sched)
    # one gap over the budget each (a slow step the streams already saw): nothing left to lose
    plan = sched.schedule(0.2)
    sched.postprocess(plan, {s.request_id: 7 for s in plan.decode}, t_s=0.2)
    assert all(s.gap_broken for s in sched.running)
    sched.add(prompt(deadline=0.2 + 1.6))
    plan = sched.schedule(0.2)
    assert plan.grant is not None and plan.grant.request_id == "doc"
    assert len(plan.decode) == 3 and plan.prefill[0].n_tokens == plan.grant.budget == plan.budget > ITL_CHUNK
    # the policy aims the step at the ceiling's share, as the ITL budget's own steps aim at theirs
    assert plan.budget == EST.chunk_for_itl(CEILING_MS * STEP_SHARE_OF_ITL, 3)


def test_the_scheduler_grants_nothing_without_a_ceiling_or_beside_streams_within_their_gap_budget():
    for ceiling, gap_s in ((None, 0.2), (CEILING_MS, 0.05)):
        sched = scheduler(ceiling)
        run_streams(sched, max_tokens=3)  # one token left after the next step's: done in 81 ms
        plan = sched.schedule(gap_s)
        sched.postprocess(plan, {s.request_id: 7 for s in plan.decode}, t_s=gap_s)
        assert all(s.gap_broken is (gap_s > ITL_MS / 1e3) for s in sched.running)
        sched.add(prompt(deadline=gap_s + 1.6))
        plan = sched.schedule(gap_s)
        assert plan.grant is None and plan.prefill[0].n_tokens == plan.budget == ITL_CHUNK


def test_the_scheduler_gives_the_others_no_more_than_the_itl_budget_when_the_granted_prompt_waits():
    sched = scheduler(CEILING_MS)
    sched.allocator = type(sched.allocator)(n_seq_max=4, n_ctx=4096)  # three chats and one prefill: ids full
    run_streams(sched)
    part_way = prompt(rid="turn", n=300, deadline=30.0)  # a far deadline: admitted, ITL-sized steps
    sched.add(part_way)
    sched.postprocess(sched.schedule(0.0), {s.request_id: 7 for s in sched.running if not s.is_prefilling})
    for s in sched.running:
        s.gap_broken = True
    sched.add(prompt(deadline=1.7))  # granted at the ceiling, but no sequence id is free for it
    plan = sched.schedule(0.1)
    assert plan.grant is None and [sl.seq.request_id for sl in plan.prefill] == ["turn"]
    assert plan.prefill[0].n_tokens == plan.budget == ITL_CHUNK


# its decisions are visible: the gate counts them for /status and /metrics, and the stall attribution names them
def test_a_gap_granted_to_a_deadline_is_counted_and_named_in_the_stall_it_made():
    from homepd.config import EngineConfig
    from homepd.engine.gate import AdmissionGate, WorkerLoad
    from homepd.measure.stalls import attribute_gaps, gaps_over
    from homepd.serve.metrics import _admission_metrics
    from homepd.tui.derive import admission_lines, stall_text

    steps = [StepRecord("colocated", 1, 0.00, 0.08, ("chat-0",), (("doc", 14),), budget=14),
             StepRecord("colocated", 2, 0.08, 0.30, ("chat-0",), (("doc", 43),), budget=43, granted_to="doc"),
             StepRecord("colocated", 3, 0.30, 0.38, ("chat-0",), (("other", 14),), budget=14)]
    gate = AdmissionGate(EngineConfig(backend="fake"))
    lost_steps = [StepRecord("colocated", 4 + i, 0.38 + 0.2 * i, 0.58 + 0.2 * i, ("chat-0",), (("late", 40),),
                             budget=40, granted_to="late", grant_lost=True) for i in range(2)]
    for s in [*steps, *lost_steps]:
        gate.observe("colocated", s, None)
    snap = gate.snapshot(WorkerLoad({}, {}, 0, 0), {})
    # a lost prompt's ceiling steps are counted apart: no deadline was kept by them
    assert snap.deadline_grants_by_worker == {"colocated": 1} and snap.lost_grants_by_worker == {"colocated": 2}
    metrics = {f.name: f for f in _admission_metrics(snap)}
    for name, n in (("homepd_deadline_grants", 1), ("homepd_lost_deadline_steps", 2)):
        assert [(s.labels["role"], s.value) for s in metrics[name].samples if s.name.endswith("_total")] == \
            [("colocated", n)]
    assert "1 gap granted to a deadline · 2 at the ceiling for a lost deadline" in admission_lines(snap)["budgets"]

    stalls = attribute_gaps([("chat-0", gaps_over([0.0, 0.08, 0.30, 0.38], 100.0))], steps)
    assert len(stalls) == 1 and stalls[0].worst.request_id == "doc" and stalls[0].worst.deadline_grant
    assert stall_text(stalls[0]) == "220 ms ← doc (43 tok, same step, granted to its deadline)"
    # a gap that no grant made says nothing of one
    plain = attribute_gaps([("chat-0", gaps_over([0.0, 0.08, 0.30, 0.38], 50.0))], steps)
    assert [s.worst.deadline_grant for s in plain] == [True, False, False]
    # a ceiling step for a prompt whose deadline was lost anyway is named as such, not as kept
    late = [steps[0], StepRecord("colocated", 2, 0.08, 0.28, ("chat-0",), (("doc", 40),), budget=40,
                                 granted_to="doc", grant_lost=True)]
    (stall,) = attribute_gaps([("chat-0", gaps_over([0.0, 0.08, 0.28], 100.0))], late)
    assert stall.worst.deadline_lost and not stall.worst.deadline_grant
    assert stall_text(stall) == "200 ms ← doc (40 tok, same step, at the gap ceiling, its deadline lost)"


def test_the_kv_store_s_time_between_two_steps_is_named_in_the_gap_it_made():
    from homepd.measure.stalls import attribute_gaps, gaps_over
    from homepd.tui.derive import stall_text

    # a restore of 150 ms before the step at 0.23: chat-0 waited 0.05 -> 0.28 for its token
    steps = [StepRecord("colocated", 1, 0.00, 0.05, ("chat-0",), ()),
             StepRecord("colocated", 2, 0.20, 0.28, ("chat-0",), (("turn", 1),), store_ms=150.0),
             StepRecord("colocated", 3, 0.28, 0.33, ("chat-0",), (("turn", 9),))]
    (stall,) = attribute_gaps([("chat-0", gaps_over([0.05, 0.28, 0.33], 100.0))], steps)
    assert stall.store_ms == 150.0 and stall.worst.request_id == "turn"
    assert stall_text(stall) == "230 ms ← turn (1 tok, same step), KV store 150 ms"
    # a gap with the store's time and no prompt in it
    alone = [steps[0], StepRecord("colocated", 2, 0.20, 0.28, ("chat-0",), (), store_ms=150.0)]
    (bare,) = attribute_gaps([("chat-0", gaps_over([0.05, 0.28], 100.0))], alone)
    assert bare.worst is None and stall_text(bare) == "230 ms ← KV store 150 ms"
    # store time before a step outside the gap is not this gap's
    (none,) = attribute_gaps([("chat-0", gaps_over([0.28, 0.45], 100.0))],
                             [*steps[:2], StepRecord("colocated", 3, 0.30, 0.45, ("chat-0",), ())])
    assert none.store_ms == 0.0 and stall_text(none) == "170 ms gap (no prompt in it)"
    # a server's request id is named by its tail, as the request table names it, so the store's time still shows
    long_id = "chatcmpl-01c840fa2c29476cb4d98693655e3baf"
    named = [StepRecord(s.worker_role, s.index, s.t_start_s, s.t_end_s, s.decode_request_ids,
                        tuple((long_id, n) for _, n in s.prefill), store_ms=s.store_ms) for s in steps]
    (long_stall,) = attribute_gaps([("chat-0", gaps_over([0.05, 0.28, 0.33], 100.0))], named)
    assert stall_text(long_stall) == "230 ms ← 8693655e3baf (1 tok, same step), KV store 150 ms"


def worker_with_three_chats():
    """A worker on the fake backend whose step model prices steps as EST, with three chats decoding:
    (model, loop, outbox)."""
    from homepd.core.protocol import SubmitRequest, WorkerSpec
    from homepd.fakellm import FakeContext, FakeModel
    from homepd.worker.loop import WorkerLoop
    from worker_fakes import Outbox

    spec = WorkerSpec(role="colocated", model_path="fake", n_ctx=4096, n_seq_max=4, chunk=512, n_threads=1,
                      backend="fake", itl_budget_ms=ITL_MS, gap_ceiling_ms=CEILING_MS)
    model, out = FakeModel(), Outbox()
    loop = WorkerLoop(spec, model, FakeContext(model, n_ctx=4096, n_batch=spec.n_batch, n_seq_max=4, n_threads=1),
                      out)
    loop.scheduler.policy.estimate = lambda: EST  # why: the fake's steps take microseconds; price them as a CPU's
    for i in range(3):
        loop.handle(SubmitRequest(f"chat-{i}", tuple(model.tokenize("hi")), SamplingParams(max_tokens=64)))
    loop.step(loop.scheduler.schedule(0.0))
    return model, loop, out


def test_a_worker_steps_the_grant_and_its_step_record_names_the_prompt():
    from homepd.core.protocol import StepReport, SubmitRequest

    model, loop, out = worker_with_three_chats()
    assert len(loop.scheduler.running) == 3 and not any(s.is_prefilling for s in loop.scheduler.running)
    for s in loop.scheduler.running:
        s.gap_broken = True  # each already missed a gap (a slow step before)
    loop.handle(SubmitRequest("doc", tuple(model.tokenize("x" * 300)), SamplingParams(max_tokens=4),
                              deadline_s=1.6))
    loop.step(loop.scheduler.schedule(0.0))
    step = out.of_type(StepReport)[-1].step
    assert step.granted_to == "doc" and set(step.decode_request_ids) == {"chat-0", "chat-1", "chat-2"}
    assert dict(step.prefill)["doc"] == step.budget > ITL_CHUNK and not step.grant_lost
    out.close()


def test_a_worker_names_a_lost_prompt_s_ceiling_steps_as_lost_in_its_step_record():
    from homepd.core.protocol import StepReport, SubmitRequest

    model, loop, out = worker_with_three_chats()
    for s in loop.scheduler.running:
        s.gap_broken = True  # each already missed a gap (a slow step before)
    loop.handle(SubmitRequest("late", tuple(model.tokenize("y" * 400)), SamplingParams(max_tokens=4),
                              deadline_s=0.2))  # 400 tokens due in 0.2 s: lost from the start
    for _ in range(3):
        loop.step(loop.scheduler.schedule(0.1))
    steps = [r.step for r in out.of_type(StepReport)]
    lost = [st for st in steps if st.granted_to == "late"]
    assert lost and all(st.grant_lost and dict(st.prefill)["late"] > ITL_CHUNK for st in lost)
    assert not any(st.grant_lost for st in steps if st.granted_to is None)
    out.close()


# a prompt whose deadline is lost anyway: lost_grant
def admitted(n=300, deadline=0.5, n_prefilled=40, rid="doc"):
    """An interactive prompt that holds a sequence id and is part-way through its prefill."""
    p = prompt(rid=rid, n=n, deadline=deadline)
    p.seq_id, p.n_prefilled = 7, n_prefilled
    return p


def test_an_admitted_prompt_past_saving_runs_in_steps_as_long_as_the_ceiling_and_no_longer():
    g = lost_grant(EST, [admitted()], streams(), 0.0, CEILING_MS, ITL_CHUNK, 512)
    assert g is not None and g.lost and g.request_id == "doc"
    assert g.budget == 62 > ITL_CHUNK  # the ceiling's own chunk: 12 + 3·2 + 62·4.5 = 297 ms <= 300 < 63 tokens
    assert g.step_ms == pytest.approx(EST.predict_ms(62, 3)) and g.step_ms <= CEILING_MS
    # beside a stream still within its gap budget, nothing: the prompt is out of its budgets whatever its steps
    assert lost_grant(EST, [admitted()], streams(broken=False), 0.0, CEILING_MS, ITL_CHUNK, 512) is None
    one_keeper = streams()
    one_keeper[2].gap_broken = False
    assert lost_grant(EST, [admitted()], one_keeper, 0.0, CEILING_MS, ITL_CHUNK, 512) is None


def test_nothing_for_a_prompt_that_can_still_be_kept_only_waits_or_beside_no_interactive_stream():
    # 260 tokens left at 62 a step: 5 steps of 297 ms, 1.485 s: a deadline at 1.6 s is deadline_grant's to weigh
    assert lost_grant(EST, [admitted(deadline=1.6)], streams(), 0.0, CEILING_MS, ITL_CHUNK, 512) is None
    waiting = prompt(deadline=0.5)  # lost too, but holds no sequence id: it is admitted in its turn
    assert lost_grant(EST, [waiting], streams(), 0.0, CEILING_MS, ITL_CHUNK, 512) is None
    assert lost_grant(EST, [admitted()], [], 0.0, CEILING_MS, ITL_CHUNK, 512) is None
    assert lost_grant(EST, [admitted()], streams(klass="background"), 0.0, CEILING_MS, ITL_CHUNK, 512) is None
    # a ceiling no larger than the ITL budget's step gives nothing more
    assert lost_grant(EST, [admitted()], streams(), 0.0, EST.predict_ms(ITL_CHUNK, 3), ITL_CHUNK, 512) is None


def test_a_kept_prompt_ahead_does_not_hide_the_lost_one_behind_it():
    kept = admitted(n=40, deadline=3.0, n_prefilled=0, rid="turn")
    g = lost_grant(EST, [kept, admitted()], streams(), 0.0, CEILING_MS, ITL_CHUNK, 512)
    assert g is not None and g.request_id == "doc" and g.budget == 62


def test_the_scheduler_steps_a_lost_prompt_at_the_ceiling_share_once_it_holds_an_id_beside_broken_streams():
    sched = scheduler(CEILING_MS)
    run_streams(sched)
    sched.add(prompt(deadline=0.3))  # 300 tokens due in 0.3 s: lost from the start
    plan = sched.schedule(0.0)  # admitted in an ITL-sized step: waiting, it had no claim on a larger one
    assert plan.grant is None and plan.prefill[0].n_tokens == ITL_CHUNK
    sched.postprocess(plan, {s.request_id: 7 for s in plan.decode}, t_s=0.08)
    plan = sched.schedule(0.08)  # every stream's gaps within budget so far: ITL-sized steps still
    assert plan.grant is None and plan.prefill[0].n_tokens == ITL_CHUNK
    sched.postprocess(plan, {s.request_id: 7 for s in plan.decode}, t_s=0.2)  # a 120 ms gap: each missed one
    assert all(s.gap_broken for s in sched.running if not s.is_prefilling)
    plan = sched.schedule(0.2)
    assert plan.grant is not None and plan.grant.lost and plan.grant.request_id == "doc"
    # the policy aims the step at the ceiling's share, as the ITL budget's own steps aim at theirs
    assert plan.prefill[0].n_tokens == plan.budget == EST.chunk_for_itl(CEILING_MS * STEP_SHARE_OF_ITL, 3)
    assert len(plan.decode) == 3 and EST.predict_ms(plan.budget, 3) <= CEILING_MS
