"""The colocated policy, without a model: stall-free chunked prefill."""
from __future__ import annotations

import random

import pytest

from homepd.core import kvpolicy
from homepd.core.terms import RequestClass
from homepd.core.kvpolicy import KVAction
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence


def seq(rid: str, n_prompt: int, max_tokens: int = 8) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(100, 100 + n_prompt)),
                    params=SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    sampled = {q.request_id: token for q in plan.decode}
    sampled.update({sl.seq.request_id: token for sl in plan.prefill if sl.completes_prompt})
    s.postprocess(plan, sampled)
    return plan


def test_long_prompt_never_exceeds_chunk_and_decode_gets_a_token_every_step():
    s = Scheduler(n_seq_max=4, n_ctx=4096, n_batch=64, chunk=64)
    short = seq("short", 5, max_tokens=200)
    s.add(short)
    run_step(s)  # short's prompt done, it now decodes
    assert short.output_ids == [7]
    s.add(seq("long", 1000))
    steps = 0
    while s.find("long").is_prefilling:
        before = len(short.output_ids)
        plan = run_step(s)
        steps += 1
        assert plan.n_prompt_tokens <= 64
        assert plan.n_decode_tokens + plan.n_prompt_tokens <= 64
        assert short in plan.decode and len(short.output_ids) == before + 1
    assert steps == -(-1000 // 63)  # 63 prompt tokens per step beside one decode


def test_unchunked_takes_whole_prompt_in_one_step():
    s = Scheduler(n_seq_max=4, n_ctx=4096, n_batch=4096, chunk=None)
    s.add(seq("a", 1500))
    plan = run_step(s)
    assert plan.n_prompt_tokens == 1500 and plan.prefill[0].completes_prompt


def test_several_short_prompts_share_one_step_within_budget():
    s = Scheduler(n_seq_max=4, n_ctx=4096, n_batch=64, chunk=64)
    for i in range(3):
        s.add(seq(f"r{i}", 20))
    plan = run_step(s)
    assert [(sl.seq.request_id, sl.n_tokens) for sl in plan.prefill] == [("r0", 20), ("r1", 20), ("r2", 20)]
    plan = run_step(s)
    assert plan.n_decode_tokens == 3 and plan.n_prompt_tokens == 0


def test_admission_respects_free_sequences():
    s = Scheduler(n_seq_max=2, n_ctx=4096, n_batch=512, chunk=512)
    for i in range(3):
        s.add(seq(f"r{i}", 10))
    plan = run_step(s)
    assert {sl.seq.request_id for sl in plan.prefill} == {"r0", "r1"}
    assert [q.request_id for q in s.waiting] == ["r2"]
    assert plan.n_waiting_for_id == 1  # the plan says what r2 waits for: a sequence id
    s.release(s.find("r0"))
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["r2"]
    assert s.find("r2").seq_id in (0, 1)
    assert plan.n_waiting_for_id == 0


@pytest.mark.parametrize("n_prefill_ids", [0, 1])
def test_a_waiting_document_starts_its_prefill_beyond_n_seq_max_while_the_chats_hold_every_id(n_prefill_ids):
    s = Scheduler(n_seq_max=2, n_ctx=4096, n_batch=64, chunk=64, n_prefill_ids=n_prefill_ids)
    for i in range(2):
        s.add(seq(f"chat{i}", 10, max_tokens=50))
    run_step(s)  # both chats have their first token and decode from now on
    s.add(seq("doc", 300))
    s.add(seq("later", 10))
    plan = run_step(s)
    chats = {q.request_id for q in plan.decode}
    assert chats == {"chat0", "chat1"}  # the chats decode every step either way
    if n_prefill_ids == 0:  # the document waits for an id while the step's prompt budget goes unused
        assert plan.prefill == () and plan.n_waiting_for_id == 2
        return
    # it prefills under a third id, in the budget the two decodes leave, and nothing more starts beyond it
    assert [(sl.seq.request_id, sl.n_tokens) for sl in plan.prefill] == [("doc", 62)]
    assert s.find("doc").seq_id == 2 and [q.request_id for q in s.waiting] == ["later"]
    assert plan.n_waiting_for_id == 1
    while s.find("doc").is_prefilling:
        plan = run_step(s)
        assert len(plan.decode) + plan.n_prompt_tokens <= 64 and "later" not in {q.request_id for q in plan.decode}
    plan = run_step(s)  # it decodes as a third sequence; "later" waits for a running id to end
    assert {q.request_id for q in plan.decode} == {"chat0", "chat1", "doc"} and s.allocator.n_running == 3
    s.release(s.find("chat0"))
    plan = run_step(s)  # two run, so "later" starts, under the place beyond n_seq_max
    assert [sl.seq.request_id for sl in plan.prefill] == ["later"] and s.allocator.n_running == 3
    assert s.allocator.n_run_limit == 2  # raised only while a step's prompts start


def test_a_handoff_admitted_outside_a_step_waits_for_one_of_n_seq_max():
    s = Scheduler(n_seq_max=1, n_ctx=4096, n_batch=64, chunk=64, n_prefill_ids=1)
    s.add(seq("a", 10, max_tokens=50))
    run_step(s)
    assert not s.can_admit(seq("imported", 10))  # a worker's own admission: the running limit is n_seq_max
    s.add(seq("b", 10))
    assert [sl.seq.request_id for sl in run_step(s).prefill] == ["b"]  # a step's start may go beyond it


def test_admission_respects_n_ctx_reservation():
    s = Scheduler(n_seq_max=4, n_ctx=100, n_batch=100, chunk=100)
    s.add(seq("a", 70, max_tokens=31))   # prompt + first decode: 71 cells, in blocks 80
    s.add(seq("b", 10, max_tokens=20))   # 16 more, plus a block of headroom for a: does not fit beside a
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["a"]
    assert s.allocator.n_cells_reserved == 80
    assert plan.n_waiting_for_id == 0  # b waits for cells, with ids free: not an id's wait
    s.release(s.find("a"))
    assert s.allocator.n_cells_reserved == 0
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["b"]


def test_eight_chats_without_max_tokens_are_admitted_together():
    """The engine gives a request without max_tokens up to 2,048 tokens: worst-case reservation would run
    these one at a time in n_ctx 4096; reserved as they grow, all eight prefill in the first step."""
    s = Scheduler(n_seq_max=8, n_ctx=4096, n_batch=512, chunk=512)
    for i in range(8):
        s.add(seq(f"chat{i}", 30, max_tokens=2048))
    plan = run_step(s)
    assert len(plan.prefill) == 8 and not s.waiting
    assert s.allocator.n_cells_reserved == 8 * 32
    for _ in range(40):  # they decode together, each reservation growing a block at a time
        plan = run_step(s)
        assert plan.n_decode_tokens == 8 and not plan.evicted
    assert all(s.allocator.n_cells_of(q.seq_id) == 80 for q in s.running)  # 30 + 41 tokens in 5 blocks


def full_context(n_ctx: int = 96) -> Scheduler:
    """Two interactive chats and one background job decoding in a context they will fill (none ends alone)."""
    s = Scheduler(n_seq_max=4, n_ctx=n_ctx, n_batch=64, chunk=64)
    s.add(seq("chat-old", 8, max_tokens=80))
    s.add(seq("batch", 8, max_tokens=80))
    s.find("batch").request_class = RequestClass.BACKGROUND
    s.add(seq("chat-new", 8, max_tokens=80))
    return s


def test_a_full_context_preempts_the_background_request_first_and_admits_nothing_that_step():
    s = full_context()
    plan = run_step(s)
    assert len(plan.prefill) == 3
    while not (plan := run_step(s)).evicted:
        assert plan.n_decode_tokens == 3
    (ev,) = plan.evicted
    batch = s.find("batch")
    assert ev.seq is batch and ev.action is KVAction.PREEMPT and batch.n_preemptions == 1
    assert list(s.waiting) == [batch] and batch.seq_id is None and not plan.prefill  # re-queued, not re-admitted
    assert batch.output_ids == [] and batch.n_prompt == 8 + (80 - batch.params.max_tokens)  # output became prompt
    assert {q.request_id for q in plan.decode} == {"chat-old", "chat-new"}


def test_with_no_background_left_the_newest_chat_is_preempted_and_every_request_gets_its_max_tokens():
    s = full_context()
    taken = []
    for _ in range(1000):
        if not s.has_work:
            break
        plan = run_step(s)
        taken += [(ev.seq.request_id, ev.action) for ev in plan.evicted]
        for q in list(s.running):
            if len(q.output_ids) >= q.params.max_tokens:
                s.release(q)
    assert taken[0] == ("batch", KVAction.PREEMPT) and ("chat-new", KVAction.PREEMPT) in taken
    assert "chat-old" not in {rid for rid, _ in taken}  # the oldest chat keeps its cells
    assert all(action is KVAction.PREEMPT for _, action in taken)
    assert not s.has_work and s.allocator.n_cells_reserved == 0


def test_a_request_preempted_too_often_ends_with_length_when_taken_again_while_decoding():
    s = full_context()
    run_step(s)
    run_step(s)  # everyone decodes
    chat_new = s.find("chat-new")
    chat_new.n_preemptions = kvpolicy.MAX_KV_PREEMPTIONS
    s.find("batch").request_class = RequestClass.INTERACTIVE  # no background left: the newest chat is the first victim
    while not (plan := run_step(s)).evicted:
        pass
    (ev,) = plan.evicted
    assert (ev.seq, ev.action) == (chat_new, KVAction.FINISH_LENGTH) and chat_new.is_finished
    assert chat_new.output_ids and s.find("chat-new") is None  # it streamed; it is out, not re-queued


@pytest.mark.parametrize("n_ctx", [64, 100, 160, 400])
def test_reservations_always_cover_the_kv_and_every_request_ends_by_the_policy(n_ctx):
    """Many requests of both classes in a small context: no step ever holds more KV than its reservations or
    the context, and each request finishes at its max_tokens or, preempted too often, with a context-full
    'length'; none is lost."""
    rng = random.Random(n_ctx)
    s = Scheduler(n_seq_max=6, n_ctx=n_ctx, n_batch=32, chunk=32)
    seqs = []
    for i in range(14):
        q = seq(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, n_ctx - 20))
        q.request_class = rng.choice(list(RequestClass))
        seqs.append(q)
        s.add(q)
    ended, finished = set(), set()
    for _ in range(20_000):
        if not s.has_work:
            break
        plan = run_step(s)
        for ev in plan.evicted:
            if ev.action is KVAction.FINISH_LENGTH:
                assert ev.seq.n_preemptions >= kvpolicy.MAX_KV_PREEMPTIONS and ev.seq.output_ids
                ended.add(ev.seq.request_id)
        for q in s.running:  # once this step's tokens are in, each sequence is within its reservation
            assert q.n_kv_tokens <= s.allocator.n_cells_of(q.seq_id)
        assert sum(q.n_kv_tokens for q in s.running) <= s.allocator.n_cells_reserved <= n_ctx
        for q in list(s.running):
            if len(q.output_ids) >= q.params.max_tokens:
                s.release(q)
                finished.add(q.request_id)
    assert not s.has_work
    assert ended | finished == {q.request_id for q in seqs} and not ended & finished


def test_prompt_advances_even_when_decodes_fill_the_chunk():
    s = Scheduler(n_seq_max=8, n_ctx=4096, n_batch=8, chunk=4)
    for i in range(5):
        s.add(seq(f"d{i}", 1, max_tokens=100))
    run_step(s)
    run_step(s)
    s.add(seq("p", 10))
    plan = run_step(s)
    assert plan.n_decode_tokens == 5 and plan.n_prompt_tokens == 1


def test_release_frees_sequence_id_and_positions_follow_outputs():
    s = Scheduler(n_seq_max=1, n_ctx=64, n_batch=16, chunk=16)
    a = seq("a", 3)
    s.add(a)
    run_step(s)
    assert a.next_decode_pos == 3 and a.n_kv_tokens == 3
    run_step(s)
    assert a.next_decode_pos == 4 and a.n_kv_tokens == 4
    s.release(a)
    assert s.allocator.free_seq_ids == [0] and not s.has_work


@pytest.mark.parametrize("chunk", [1, 16, 64, None])
def test_every_prompt_token_is_scheduled_exactly_once_in_order(chunk):
    s = Scheduler(n_seq_max=3, n_ctx=2048, n_batch=2048 if chunk is None else max(chunk, 3), chunk=chunk)
    seqs = [seq(f"r{i}", n) for i, n in enumerate([1, 17, 130, 64, 5])]
    for q in seqs:
        s.add(q)
    seen: dict[str, list[int]] = {q.request_id: [] for q in seqs}
    for _ in range(2000):
        if not s.has_work:
            break
        plan = run_step(s)
        for sl in plan.prefill:
            seen[sl.seq.request_id].extend(range(sl.start, sl.stop))
        for q in list(s.running):
            if len(q.output_ids) >= q.params.max_tokens:
                s.release(q)
    assert not s.has_work
    for q in seqs:
        assert seen[q.request_id] == list(range(q.n_prompt))
        assert len(q.output_ids) == q.params.max_tokens


def test_prefill_only_worker_reserves_the_prompt_not_the_outputs():
    s = Scheduler(n_seq_max=4, n_ctx=4096, n_batch=64, chunk=64, decodes=False)
    for i in range(4):
        s.add(seq(f"r{i}", 50, max_tokens=4000))  # would reserve ~4050 cells each on a decoding worker
    while s.waiting or any(q.is_prefilling for q in s.running):
        plan = run_step(s)
        assert not plan.decode  # a prefill worker never decodes
    assert len(s.running) == 4 and s.allocator.n_cells_reserved == 200  # all four fit: prompts only
    assert all(len(q.output_ids) == 1 for q in s.running)  # first tokens, waiting for hand-off


def test_with_streams_a_request_fills_its_own_stream_and_the_step_model_sees_one_stream_s_depth():
    def both(stream_cells: int | None) -> Scheduler:
        s = Scheduler(n_seq_max=2, n_ctx=1024, n_batch=1024, chunk=1024, stream_cells=stream_cells)
        s.add(seq("a", 500, max_tokens=12))  # 511 cells at most: a whole stream of 512
        s.add(seq("b", 500, max_tokens=12))
        return s
    # one pool: the second waits, as a block of headroom must stay for the first one's growth
    unified = both(None)
    assert [sl.seq.request_id for sl in run_step(unified).prefill] == ["a"]
    # two streams of 512: the first grows in its own stream, so the second is admitted beside it
    streams = both(512)
    assert [sl.seq.request_id for sl in run_step(streams).prefill] == ["a", "b"]
    # each token attends over its own stream: the step model is told the sequences' mean, not their sum
    plan = run_step(streams)
    assert len(plan.decode) == 2 and plan.kv_in_use == 500  # each holds its 500 prompt cells when planned
    plan = run_step(unified)
    assert [q.request_id for q in plan.decode] == ["a"] and unified.waiting  # b still waits for cells
    assert plan.kv_in_use == 512  # one sequence: its 500 cells and the decode's, padded as llama.cpp pads them


def test_with_streams_a_request_longer_than_its_stream_is_never_admitted():
    s = Scheduler(n_seq_max=2, n_ctx=1024, n_batch=512, chunk=512, stream_cells=512)
    s.add(seq("long", 600))
    plan = run_step(s)
    assert not plan.prefill and s.find("long").seq_id is None  # the controller refuses it before (one stream)
