"""The colocated policy, without a model: stall-free chunked prefill."""
from __future__ import annotations

import pytest

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
    s.release(s.find("r0"))
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["r2"]
    assert s.find("r2").seq_id in (0, 1)


def test_admission_respects_n_ctx_reservation():
    s = Scheduler(n_seq_max=4, n_ctx=100, n_batch=100, chunk=100)
    s.add(seq("a", 50, max_tokens=31))   # needs 80 cells
    s.add(seq("b", 10, max_tokens=20))   # needs 29: does not fit beside a
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["a"]
    assert s.allocator.n_cells_reserved == 80
    s.release(s.find("a"))
    assert s.allocator.n_cells_reserved == 0
    plan = run_step(s)
    assert [sl.seq.request_id for sl in plan.prefill] == ["b"]


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
