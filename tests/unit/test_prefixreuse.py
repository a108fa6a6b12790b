"""Prefix reuse in the scheduler and the allocator on constructed token sequences, its plans executed on
the fake context (homepd.fakellm), which checks positions like llama.cpp and counts the cells in use."""
from __future__ import annotations

import pytest

from homepd.core.allocator import KVAllocator
from homepd.core.terms import ReuseMode
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.fakellm import FakeContext, FakeModel
from homepd.worker.prefixkv import ContextKV


def make(n_ctx=256, n_seq_max=4, max_cached_cells=256, chunk=64, can_share=True, n_cached_ids=0, flash_attn=False):
    ctx = FakeContext(FakeModel(), n_ctx=n_ctx, n_batch=chunk, n_seq_max=n_seq_max + n_cached_ids, n_threads=1)
    kv = ContextKV(ctx)
    kv.can_share = can_share
    s = Scheduler(n_seq_max=n_seq_max, n_ctx=n_ctx, n_batch=chunk, chunk=chunk, kv_ops=kv,
                  reuse_mode=ReuseMode.PREFIX, max_cached_cells=max_cached_cells, n_cached_ids=n_cached_ids,
                  flash_attn=flash_attn)
    return s, ctx


def step(s: Scheduler, ctx: FakeContext, token: int = 40):
    """One worker step: schedule, drop evicted KV, decode the batch on the fake context, postprocess,
    and release (keeping its prefix) every sequence that reached its max_tokens."""
    plan = s.schedule()
    for ev in plan.evicted:
        ctx.seq_rm(ev.seq_id)
    tokens, positions, ids = [], [], []
    for q in plan.decode:
        tokens.append(q.output_ids[-1]), positions.append(q.next_decode_pos), ids.append(q.seq_id)
    for sl in plan.prefill:
        tokens += sl.seq.prompt_ids[sl.start:sl.stop]
        positions += range(sl.start, sl.stop)
        ids += [sl.seq.seq_id] * sl.n_tokens
    if tokens:
        ctx.decode(tokens, positions, ids, [False] * len(tokens))
    sampled = {q.request_id: token for q in plan.decode}
    sampled.update({sl.seq.request_id: token for sl in plan.prefill if sl.completes_prompt})
    for q in s.postprocess(plan, sampled):
        if len(q.output_ids) >= q.params.max_tokens:
            seq_id = q.seq_id
            if not s.release(q, keep_prefix=True):
                ctx.seq_rm(seq_id)
    return plan


def finish(s, ctx, *seqs):
    for q in seqs:
        s.add(q)
    plans = []
    while any(not q.is_finished for q in seqs):
        plans.append(step(s, ctx))
    return plans


def request(rid, prompt, max_tokens=4):
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens))


def prefilled(plans, rid):
    return sum(sl.n_tokens for p in plans for sl in p.prefill if sl.seq.request_id == rid)


DOC = list(range(100, 180))  # 80 tokens


def test_a_next_turn_takes_the_finished_sequence_and_computes_only_its_new_tokens():
    s, ctx = make()
    first = request("a", DOC)
    finish(s, ctx, first)
    kept = DOC + first.output_ids[:-1]  # the last output never entered the KV
    assert s.allocator.n_cached == 1 and s.allocator.n_cells_in_use == len(kept) == ctx.n_cells_used
    nxt = request("b", kept + [40, 7, 8, 9])
    plans = finish(s, ctx, nxt)
    assert nxt.n_reused == len(kept) and plans[0].reused == (nxt,)
    assert prefilled(plans, "b") == 4  # the last answer token and the three new ones
    assert nxt.seq_id == 0  # the finished sequence's own id
    assert s.prefixes.stats().n_hit_tokens == len(kept) and s.prefixes.stats().n_hits == 1


@pytest.mark.parametrize("flash_attn", [False, True], ids=["unified", "flash-attention"])
def test_a_step_prices_the_idle_cached_cells_its_tokens_attend_over(flash_attn):
    # without flash attention a step's tokens are multiplied by the unified cache's whole used range (padded to
    # 256), masked or not: a finished conversation's cached KV costs the next request's steps as running cells do
    s, ctx = make(n_ctx=2048, max_cached_cells=1024, chunk=512, flash_attn=flash_attn)
    long_doc = list(range(1000, 1400))
    a = request("a", long_doc)
    finish(s, ctx, a)
    idle = s.allocator.n_cells_cached_only
    assert idle == ctx.n_cells_used > len(long_doc)
    b = request("b", list(range(300, 320)), max_tokens=3)   # shares nothing with a: a stays cached, idle
    s.add(b)
    first = step(s, ctx)
    assert first.prefill[0].seq is b and first.prefill[0].n_tokens == 20
    assert first.kv_in_use == (20 if flash_attn else 512)  # a's 403 cells below b's 20: 423, padded
    # a's next turn takes its cells over: running cells then, not idle ones, and no cell is counted twice
    c = request("c", long_doc + a.output_ids[:-1] + [7])
    s.add(c)
    plan = step(s, ctx)
    assert c.n_reused == idle and s.allocator.n_cells_cached_only == 0
    if flash_attn:  # b's and c's cells, each once (b's decode token enters in the step: the plan counts before it)
        assert plan.kv_in_use + len(plan.decode) == ctx.n_cells_used and len(plan.decode) == 1
    else:
        assert plan.kv_in_use == 512 and s.allocator.cells.used_max == ctx.n_cells_used


def test_a_second_question_on_a_document_shares_its_cells_and_the_first_stays_cached():
    s, ctx = make()
    finish(s, ctx, request("q1", DOC + [1, 2, 3]))
    q2 = request("q2", DOC + [5, 6])
    s.add(q2)
    step(s, ctx)
    assert q2.n_reused == len(DOC) and q2.seq_id == 1  # a copy under a new id
    # the document's cells are counted once, by the allocator as by the context
    assert s.allocator.n_cells_shared == len(DOC)
    assert ctx.n_cells_used == len(DOC) + 3 + 3 + 2  # q1's tail and outputs, q2's own two prompt tokens
    assert s.prefixes.stats().n_cached_cells == 3 + 3  # what only q1 holds
    while not q2.is_finished:
        step(s, ctx)
    assert s.allocator.n_cached == 2 and s.allocator.n_cells_in_use == ctx.n_cells_used
    q3 = request("q3", DOC + [1, 2, 3, 40, 40, 40, 9])  # q1's conversation goes on: its entry is still there
    finish(s, ctx, q3)
    assert q3.n_reused == len(DOC) + 3 + 3


def test_evicting_the_source_keeps_the_shared_cells_with_who_copied_them():
    a = KVAllocator(n_seq_max=4, n_ctx=100)
    src = a.allocate(40)
    a.cache(src, 30)
    dst = a.allocate_sharing(48, src, 20)
    assert a.n_cells_in_use == 30 + 48 - 20
    grand = a.allocate_sharing(16, dst, 10)
    assert a.n_cells_in_use == 30 + 48 + 16 - 20 - 10
    a.uncache(src)  # its 10 cells past the copy go; the 20 copied stay dst's
    assert a.n_cells_in_use == 48 + 16 - 10 and a.shares_of(dst) is None and a.shares_of(grand) == (dst, 10)
    a.free(dst)
    assert a.n_cells_in_use == 16 and a.shares_of(grand) is None


def test_trimming_a_shared_sequence_leaves_the_cells_its_copies_hold():
    a = KVAllocator(n_seq_max=4, n_ctx=200)
    root = a.allocate(100)
    a.cache(root, 100)
    mid = a.allocate_sharing(90, root, 80)
    a.cache(mid, 90)
    leaf = a.allocate_sharing(70, mid, 60)
    a.trim_cached(mid, 50)  # leaf's cells 50..59 are still root's: leaf now shares 60 with root
    assert a.shares_of(leaf) == (root, 60) and a.shares_of(mid) == (root, 50)
    assert a.n_cells_in_use == 100 + 70 - 60


def test_cached_prefixes_never_keep_a_request_waiting():
    s, ctx = make(n_ctx=256, n_seq_max=3)
    finish(s, ctx, request("a", range(1, 100)), request("b", range(200, 300)), request("c", range(300, 340)))
    assert s.allocator.n_cached == 3 and not s.allocator.free_seq_ids
    big = request("big", range(500, 700))  # needs an id and more cells than are free
    assert s.can_admit(big)
    plans = finish(s, ctx, big)
    assert big.n_reused == 0 and not any(p.evicted for p in plans)
    assert s.prefixes.n_evictions >= 2 and s.prefixes.index.entry_of(big.seq_id) is not None


def test_a_decoding_request_evicts_cached_prefixes_before_any_running_one_is_preempted():
    s, ctx = make(n_ctx=160, n_seq_max=3, chunk=64)
    finish(s, ctx, request("old", range(1, 60)))  # 62 cells cached
    long = request("long", range(200, 260), max_tokens=90)  # grows to 149 cells: needs the cached ones
    plans = finish(s, ctx, long)
    assert not any(p.evicted for p in plans) and long.n_preemptions == 0
    assert s.prefixes.n_evictions == 1 and len(long.output_ids) == 90


def test_least_recently_used_is_evicted_first_and_the_budget_bounds_cached_cells():
    s, ctx = make(n_ctx=512, n_seq_max=4, max_cached_cells=100)
    finish(s, ctx, request("a", range(1, 40)))
    finish(s, ctx, request("b", range(100, 140)))
    assert s.allocator.n_cached == 2
    finish(s, ctx, request("c", range(200, 240)))  # 3 x 42 cells > 100: a goes
    assert {e.tokens[0] for e in s.prefixes.index.lru()} == {100, 200}
    assert s.prefixes.stats().n_cached_cells <= 100 and ctx.n_cells_used == s.allocator.n_cells_in_use


def test_without_sharing_a_partial_match_takes_the_entry_and_drops_its_tail():
    s, ctx = make(can_share=False)
    finish(s, ctx, request("q1", DOC + [1, 2, 3]))
    q2 = request("q2", DOC + [5, 6])
    plans = finish(s, ctx, q2)
    assert q2.n_reused == len(DOC) and q2.seq_id == 0 and prefilled(plans, "q2") == 2
    assert s.allocator.n_cells_shared == 0 and s.allocator.n_cells_in_use == ctx.n_cells_used


def test_a_refused_trim_prefills_the_whole_prompt():
    s, ctx = make(can_share=False)
    s.prefixes.kv.trim = lambda seq_id, n_keep: None  # e.g. a recurrent cache
    finish(s, ctx, request("q1", DOC + [1, 2, 3]))
    q2 = request("q2", DOC + [5, 6])
    plans = finish(s, ctx, q2)
    assert q2.n_reused == 0 and prefilled(plans, "q2") == len(DOC) + 2


def test_the_last_prompt_token_is_always_computed():
    s, ctx = make()
    first = request("a", DOC, max_tokens=1)  # its KV holds the prompt alone
    finish(s, ctx, first)
    again = request("b", DOC)
    plans = finish(s, ctx, again)
    assert again.n_reused == len(DOC) - 1 and prefilled(plans, "b") == 1


def test_a_few_shared_leading_tokens_are_not_worth_a_reuse():
    s, ctx = make()
    finish(s, ctx, request("a", [1] + DOC))
    other = request("b", [1] + list(range(300, 340)))  # shares only its BOS
    plans = finish(s, ctx, other)
    assert other.n_reused == 0 and prefilled(plans, "b") == 41 and s.prefixes.stats().n_hits == 0


def test_a_follow_up_whose_history_is_cached_is_ordered_as_the_short_job_it_is():
    """The deadline order counts a waiting prompt's cached prefix as done: a follow-up turn due soon goes
    before a long prompt already past its deadline (counted whole, the follow-up looked late too, and the
    long one, due earlier, went first)."""
    from homepd.core.terms import StepEstimate
    from homepd.core.steppolicy import StepPolicy

    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=4.5, ms_per_decode_token=2.0, ms_per_kv_ktoken=0.0,
                       n_steps=100, error_ms=0.0)
    ctx = FakeContext(FakeModel(), n_ctx=512, n_batch=64, n_seq_max=4, n_threads=1)
    s = Scheduler(n_seq_max=4, n_ctx=512, n_batch=64, chunk=64, kv_ops=ContextKV(ctx), reuse_mode=ReuseMode.PREFIX,
                  max_cached_cells=512, policy=StepPolicy(64, 64, estimate=lambda: est))
    first = request("a", DOC)
    finish(s, ctx, first)
    late = request("late", list(range(300, 450)))
    late.deadline_s = -1.0                                     # already past: 150 tokens cannot be on time
    follow = request("b", DOC + first.output_ids[:-1] + [40, 7, 8, 9])
    follow.deadline_s = 0.1                                    # 87 tokens whole: 0.4 s; its 4 new ones: 0.02 s
    s.add(late)
    s.add(follow)
    assert follow.n_expected_reuse == len(DOC) + len(first.output_ids) - 1 and late.n_expected_reuse == 0
    plan = s.schedule(0.0)
    assert [sl.seq.request_id for sl in plan.prefill][0] == "b" and follow.n_reused == follow.n_expected_reuse


def test_a_step_in_which_an_interactive_prompt_completes_carries_only_an_itl_share_after_it():
    """Its first token waits for the whole step: the long prompt behind it gets what 85 ms hold, not the rest
    of the budget (a background prompt completing leaves the budget as it was)."""
    from homepd.core.terms import RequestClass
    from homepd.core.terms import StepEstimate
    from homepd.core.steppolicy import STEP_SHARE_OF_ITL, StepPolicy

    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=4.5, ms_per_decode_token=2.0, ms_per_kv_ktoken=0.0,
                       n_steps=100, error_ms=0.0)
    for klass, tail in ((RequestClass.INTERACTIVE, int(100.0 * STEP_SHARE_OF_ITL // 4.5)),
                        (RequestClass.BACKGROUND, 256 - 8)):
        ctx = FakeContext(FakeModel(), n_ctx=1024, n_batch=256, n_seq_max=4, n_threads=1)
        s = Scheduler(n_seq_max=4, n_ctx=1024, n_batch=256, chunk=256, kv_ops=ContextKV(ctx),
                      reuse_mode=ReuseMode.PREFIX, max_cached_cells=0,
                      policy=StepPolicy(256, 256, itl_budget_ms=100.0, estimate=lambda: est, idle_step_ms=10_000.0))
        short = request("q", list(range(200, 208)))
        short.request_class = klass
        short.deadline_s = 1.0
        doc = request("doc", list(range(300, 700)))
        doc.request_class, doc.deadline_s = klass, 2.0
        s.add(short)
        s.add(doc)
        plan = s.schedule(0.0)
        assert [(sl.seq.request_id, sl.n_tokens) for sl in plan.prefill] == [("q", 8), ("doc", tail)], klass


def test_an_admitted_prompt_goes_on_while_one_ahead_of_it_waits_for_a_sequence_id():
    s = Scheduler(n_seq_max=2, n_ctx=1024, n_batch=64, chunk=64)
    stream = request("stream", range(10, 15), max_tokens=100)
    doc = request("doc", range(100, 400))
    doc.request_class = "background"
    s.add(stream), s.add(doc)
    plan = s.schedule()
    s.postprocess(plan, {"stream": 7})
    assert doc.seq_id is not None and stream.seq_id is not None  # both ids held
    s.add(request("turn", range(600, 620)))  # interactive: served before the doc, but no id is free
    plan = s.schedule()
    assert [sl.seq.request_id for sl in plan.prefill] == ["doc"] and s.waiting[0].request_id == "turn"


@pytest.mark.parametrize("n_cached_ids", [0, 2])
def test_finished_sequences_share_the_running_ids_places_whatever_ids_are_kept_for_paused_prefills(n_cached_ids):
    """Two running ids and three one-turn requests: the first two stay cached, and the third's admission
    evicts the least recently used, with or without ids kept for cached prefixes (those are for paused
    prefills; a finished request's cells cost every step and may never be asked for again)."""
    s, ctx = make(n_ctx=1024, n_seq_max=2, max_cached_cells=512, n_cached_ids=n_cached_ids)
    firsts = [request(f"c{i}", range(1000 * i + 100, 1000 * i + 140)) for i in range(1, 4)]
    for q in firsts[:2]:
        finish(s, ctx, q)
    assert s.prefixes.stats().n_evictions == 0 and s.allocator.n_cached == 2
    finish(s, ctx, firsts[2])
    assert s.prefixes.stats().n_evictions == 1 and s.allocator.n_cached == 2
    assert sorted(e.tokens[0] for e in s.prefixes.index.lru()) == [2100, 3100]  # the first, least recently used, went
    again = request("c2-next", [*firsts[1].prompt_ids, *firsts[1].output_ids, 7, 8, 9])
    finish(s, ctx, again)
    assert again.n_reused == 43  # the second's whole first turn (40 + 4 answer tokens, the last never computed)


class RecordingStore:
    """A stand-in for the KV store tier (``StoreOps``) that records what is saved, in order."""
    capacity_bytes = 1 << 20

    def __init__(self):
        self.saved: list[tuple[int, tuple[int, ...]]] = []

    def save(self, seq_id, tokens):
        self.saved.append((seq_id, tuple(tokens)))

    def peek(self, prompt_ids, mode, max_tokens):
        return None

    lookup = peek


def test_before_an_unload_every_cached_prefix_is_saved_coldest_first_and_stays_in_the_context():
    s, ctx = make(n_ctx=512, n_seq_max=4, max_cached_cells=300)
    finish(s, ctx, request("a", range(1, 40)))
    finish(s, ctx, request("b", range(100, 140)))
    finish(s, ctx, request("a2", [*range(1, 40), 50, 51]))  # a's conversation again: now the hottest
    store = s.prefixes.store = RecordingStore()
    n_cached, n_cells = s.allocator.n_cached, ctx.n_cells_used
    assert s.prefixes.save_all() == n_cached == 3
    saved = [tokens for _, tokens in store.saved]
    assert saved[-1][:41] == (*range(1, 40), 50, 51)  # the hottest last: a full store evicts it last
    assert [t[0] for t in saved].index(100) < len(saved) - 1  # b's, used before, is saved before it
    assert (s.allocator.n_cached, ctx.n_cells_used) == (n_cached, n_cells)  # nothing left the context
