"""The KV store tier on constructed token sequences: its index (longest match, LRU eviction by bytes, the
budget, superseded entries, a rebuild after a restart), the restore-or-recompute rule, and the prefix cache
saving an evicted entry and restoring it, on the fake context over a real store segment."""
from __future__ import annotations

import contextlib
import errno
import os
import time

import pytest

from homepd.core.terms import RequestClass, ReuseMode, StepEstimate
from homepd.core.prefixreuse import store_is_faster
from homepd.core.protocol import StoreDropped, StoreSaved
from homepd.core.scheduler import Scheduler
from homepd.core.steppolicy import StepPolicy
from homepd.fakellm import FakeContext, FakeModel
from homepd.kv.pool import extent_bytes_for
from homepd.kv.ring import PAGE_BYTES
from homepd.kv.store import StoreBook
from homepd.kv.storeindex import StoreIndex
from homepd.worker.prefixkv import ContextKV
from homepd.worker.storekv import MIN_STORE_TOKENS, ContextStore

from test_prefixreuse import finish, request, step

PAYLOAD = 3 * PAGE_BYTES  # every entry below: a header page and three payload pages
EXTENT = extent_bytes_for(PAYLOAD)


def save(index: StoreIndex, tokens) -> list:
    offset, extent, evicted = index.place(PAYLOAD)
    index.insert(offset, extent, PAYLOAD, tokens)
    return evicted


def test_longest_match_prefers_the_longest_shared_prefix_and_exact_mode_only_whole_entries():
    index = StoreIndex(8 * EXTENT)
    save(index, range(0, 100))
    save(index, [*range(0, 50), *range(500, 550)])
    prompt = [*range(0, 80), 7, 7]
    hit = index.longest_match(prompt, ReuseMode.PREFIX)
    assert hit.n_tokens == 80 and hit.entry.tokens == tuple(range(100))
    assert index.longest_match(prompt, ReuseMode.EXACT) is None  # no entry lies wholly inside the prompt
    whole = index.longest_match([*range(100), 1, 2], ReuseMode.EXACT)
    assert whole.n_tokens == 100
    assert index.longest_match([9, 9, 9], ReuseMode.PREFIX) is None


def test_a_full_store_evicts_the_least_recently_used_entries_until_the_new_one_fits():
    index = StoreIndex(3 * EXTENT)  # the byte budget: three entries
    for first in (0, 1000, 2000):
        assert save(index, range(first, first + 70)) == []
    index.touch(index.longest_match(range(0, 70), ReuseMode.PREFIX).entry)  # the oldest is used again
    evicted = save(index, range(3000, 3070))
    assert [e.tokens[0] for e in evicted] == [1000]  # the least recently used, not the oldest saved
    assert len(index) == 3 and index.used_bytes == 3 * EXTENT <= index.capacity_bytes
    assert [e.tokens[0] for e in index.entries()] == [2000, 0, 3000]
    assert index.place(4 * EXTENT) is None and not index.can_ever_fit(4 * EXTENT)  # never fits: nothing evicted
    assert len(index) == 3
    index.allocator.check()


def test_an_entry_is_covered_by_a_longer_one_and_supersedes_its_own_prefixes():
    index = StoreIndex(8 * EXTENT)
    save(index, range(0, 70))
    save(index, range(0, 90))
    assert index.covers(range(0, 80)) and not index.covers(range(0, 95))
    assert sorted(len(e.tokens) for e in index.superseded_by(range(0, 95))) == [70, 90]
    assert index.superseded_by(range(1, 95)) == []


def test_a_rebuilt_index_holds_the_same_entries_and_allocates_around_them():
    index = StoreIndex(4 * EXTENT)
    for first in (0, 1000):
        save(index, range(first, first + 70))
    rebuilt = StoreIndex(4 * EXTENT)
    for entry in index.entries():
        rebuilt.restore_entry(entry)
    assert rebuilt.longest_match(range(1000, 1080), ReuseMode.PREFIX).n_tokens == 70
    offset, _, evicted = rebuilt.place(PAYLOAD)
    assert evicted == [] and offset not in {e.offset for e in index.entries()}


def estimate(ms_per_prompt_token: float) -> StepEstimate:
    return StepEstimate(base_ms=5.0, ms_per_prompt_token=ms_per_prompt_token, ms_per_decode_token=1.0,
                        ms_per_kv_ktoken=0.0, n_steps=20, error_ms=0.1)


def test_the_store_is_used_only_when_its_measured_restore_beats_the_predicted_prefill():
    assert store_is_faster(200, 200, 0.01, estimate(1.0))        # 2 ms restore vs 200 ms of prefill
    assert not store_is_faster(200, 200, 0.01, estimate(0.005))  # a fast GPU prefill: recompute it
    assert not store_is_faster(1000, 10, 0.01, estimate(0.5))    # a long restore to save ten tokens
    assert store_is_faster(200, 200, None, None)  # not measured yet: the first restore measures it
    assert not store_is_faster(200, 0, None, None)  # nothing to gain


@contextlib.contextmanager
def store_scheduler(max_cached_cells: int, policy: StepPolicy | None = None, n_cached_ids: int = 0,
                    clock=time.monotonic):
    """A scheduler of four running ids (and ``n_cached_ids`` for cached prefixes) whose prefix cache holds
    ``max_cached_cells`` cells (stepping by ``policy``, else a chunk of 64), over the fake context and a real
    1 MiB store segment (its saves and restores timed by ``clock``): (scheduler, context, store, messages sent, the
    controller's book)."""
    ctx = FakeContext(FakeModel(), n_ctx=512, n_batch=64, n_seq_max=4 + n_cached_ids, n_threads=1)
    sent: list = []
    book = StoreBook({"colocated": 1 << 20})
    store = ContextStore(ctx, sent.append, "f" * 64, lambda: None, clock=clock)
    store.attach(book.attach_message("colocated"))
    try:
        yield (Scheduler(n_seq_max=4, n_ctx=512, n_batch=64, chunk=64, policy=policy, kv_ops=ContextKV(ctx),
                         reuse_mode=ReuseMode.PREFIX, max_cached_cells=max_cached_cells, store=store,
                         n_cached_ids=n_cached_ids),
               ctx, store, sent, book)
    finally:
        store.segment.close()
        book.close()


@pytest.fixture
def store_and_scheduler():
    """A scheduler whose prefix cache holds 100 cells, over the fake context and a real 1 MiB store segment."""
    with store_scheduler(100) as parts:
        yield parts


def test_an_entry_evicted_for_room_is_saved_and_a_later_prompt_restores_it(store_and_scheduler):
    s, ctx, store, sent, book = store_and_scheduler
    chat = list(range(10, 10 + 80))
    a = request("a", chat)
    finish(s, ctx, a)
    finish(s, ctx, request("b", range(200, 280)))  # over the 100 cached cells: a's entry goes to the store
    (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
    assert len(saved.tokens) == 80 + 3 >= MIN_STORE_TOKENS and store.n_entries == 1
    book.saved("colocated", saved)
    turn = request("c", [*saved.tokens, 1, 2, 3])
    plans = finish(s, ctx, turn)
    assert turn.is_restored and turn.n_reused == len(saved.tokens)
    assert plans[0].prefill[0].start == len(saved.tokens)  # only the new tokens are prefilled
    # b's entry went to the store too, making room for the turn
    assert s.prefixes.stats().n_store_hits == 1 and s.prefixes.stats().n_store_entries == 2
    # what the context holds for the turn (kept as a cached entry now) is the conversation, from the store
    assert ctx._seqs[turn.seq_id][:len(saved.tokens)] == list(saved.tokens)
    # a restarted worker's store is rebuilt from what the controller was told
    again = ContextStore(ctx, sent.append, "f" * 64, lambda: None)
    again.attach(book.attach_message("colocated"))
    assert again.lookup([*saved.tokens, 9], ReuseMode.PREFIX, 1000).n_tokens == len(saved.tokens)
    again.segment.close()


def test_a_turn_whose_history_is_in_the_store_only_is_expected_to_reuse_it(store_and_scheduler):
    """The deadline order counts a waiting turn's expected reuse as done work: a history the context no longer
    holds but the store does counts, and looking it up on arrival leaves the store's recency as it was."""
    s, ctx, store, sent, book = store_and_scheduler
    finish(s, ctx, request("a", range(10, 90)))
    finish(s, ctx, request("b", range(200, 280)))  # a's entry goes to the store, b's stays in the context
    (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
    book.saved("colocated", saved)
    before = [e.tokens[0] for e in store.segment.index.entries()]
    turn = request("c", [*saved.tokens, 1, 2, 3])
    s.add(turn)
    assert turn.n_expected_reuse == len(saved.tokens)
    assert [e.tokens[0] for e in store.segment.index.entries()] == before
    stranger = request("d", range(600, 690))
    s.add(stranger)
    assert stranger.n_expected_reuse == 0


def allocated_bytes(store) -> int:
    return os.stat(f"/dev/shm/{store.segment.arena.names[0]}").st_blocks * 512


def test_a_save_takes_its_pages_of_dev_shm_before_writing_them(store_and_scheduler):
    s, ctx, store, sent, _ = store_and_scheduler
    before = allocated_bytes(store)  # the store is not pre-faulted: the arena header page, little more
    finish(s, ctx, request("a", range(10, 90)))
    finish(s, ctx, request("b", range(200, 280)))  # a's entry goes to the store
    (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
    assert allocated_bytes(store) - before >= saved.extent_bytes
    assert s.prefixes.stats().n_store_no_room == 0


def test_no_room_in_dev_shm_refuses_the_save_instead_of_a_sigbus_and_keeps_the_store_sound(store_and_scheduler,
                                                                                            monkeypatch):
    """posix_fallocate's ENOSPC stands for a /dev/shm that filled up after the store was created (Docker's
    64 MB default, shared with other programs): a write into such a page would kill the worker with SIGBUS."""
    s, ctx, store, sent, _ = store_and_scheduler
    finish(s, ctx, request("a", range(10, 90)))
    before = allocated_bytes(store)

    def no_room(fd, offset, n_bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    finish(s, ctx, request("b", range(200, 280)))  # a's entry would go to the store: no room for it
    assert not [m for m in sent if isinstance(m, StoreSaved)] and store.n_entries == 0
    assert allocated_bytes(store) == before  # not one page of it was written
    assert s.prefixes.stats().n_store_no_room == 1
    store.segment.index.allocator.check()
    monkeypatch.undo()  # room again: the next eviction is saved
    finish(s, ctx, request("c", range(400, 480)))
    assert [m for m in sent if isinstance(m, StoreSaved)] and store.n_entries == 1


def test_short_prefixes_are_not_saved_and_a_superseded_entry_is_dropped(store_and_scheduler):
    s, ctx, store, sent, _ = store_and_scheduler
    finish(s, ctx, request("short", range(10, 30)))
    finish(s, ctx, request("b", range(200, 290)))  # evicts "short" (23 tokens): too short to save
    assert store.n_entries == 0
    store.save(0, tuple(range(200, 270)))  # as if its first 70 tokens had been saved before
    ctx_ids = [k for k, v in ctx._seqs.items() if v[:1] == [200]]
    store.save(ctx_ids[0], tuple(ctx._seqs[ctx_ids[0]]))
    assert store.n_entries == 1  # the longer entry replaced the one it contains
    assert any(isinstance(m, StoreDropped) for m in sent)


def test_the_controller_unlinks_every_store_segment_it_created():
    book = StoreBook({"replica-0": 1 << 20, "replica-1": 1 << 20, "tiny": 4096})
    names = [n for a in book.segments.values() for n in a.names]
    assert len(names) == 2  # a part too small to hold a prefix gets no segment
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    book.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_the_default_store_takes_a_quarter_of_the_ram_left_within_half_of_dev_shm():
    from homepd.hw.placement import MAX_DEFAULT_STORE_BYTES, RAM_RESERVE_BYTES, store_bytes_for

    gib = 1 << 30
    assert store_bytes_for(RAM_RESERVE_BYTES + 9 * gib, gib, shm_free_bytes=64 * gib) == 2 * gib
    assert store_bytes_for(RAM_RESERVE_BYTES + 9 * gib, gib, shm_free_bytes=64 << 20) == 32 << 20  # a container
    assert store_bytes_for(RAM_RESERVE_BYTES + 100 * gib, 0, shm_free_bytes=64 * gib) == MAX_DEFAULT_STORE_BYTES
    assert store_bytes_for(RAM_RESERVE_BYTES, gib, shm_free_bytes=64 * gib) == 0  # no RAM left
    assert store_bytes_for(None, 0) == 0  # RAM unknown: no store unless asked for


def test_kv_store_flag_wins_and_the_fake_backend_has_no_store_unless_asked():
    from homepd.config import EngineConfig
    from homepd.launch import kv_store_bytes

    assert kv_store_bytes(EngineConfig(backend="fake"), "fake://model") == 0
    assert kv_store_bytes(EngineConfig(backend="fake", kv_store_bytes=3 << 20), "fake://model") == 3 << 20
    assert kv_store_bytes(EngineConfig(kv_store_bytes=0), "unused") == 0  # off
    with pytest.raises(Exception, match="kv_store_bytes"):
        EngineConfig(kv_store_bytes=-1).validated()
    from homepd.config import parse_size_or_off

    assert parse_size_or_off("0") == parse_size_or_off("off") == 0 and parse_size_or_off("2G") == 2 << 30


def test_a_hit_evicted_from_a_full_store_while_making_room_for_it_falls_back_to_a_prefill():
    from homepd.core.protocol import AttachStore
    from homepd.kv.pool import KVArena
    from homepd.kv.segment import STORE_PREFIX

    # a store that holds one entry, and a context too small for the turn beside the cached prefix
    ctx = FakeContext(FakeModel(), n_ctx=160, n_batch=64, n_seq_max=4, n_threads=1)
    arena = KVArena.create(extent_bytes_for(1), prefix=STORE_PREFIX, prefault=False)
    store = ContextStore(ctx, [].append, "f" * 64, lambda: None)
    store.attach(AttachStore(arena.names))
    s = Scheduler(n_seq_max=4, n_ctx=160, n_batch=64, chunk=64, kv_ops=ContextKV(ctx), reuse_mode=ReuseMode.PREFIX,
                  max_cached_cells=100, store=store)
    try:
        a = request("a", range(10, 90))
        finish(s, ctx, a)
        finish(s, ctx, request("b", range(200, 280)))  # a's entry goes to the store
        saved = store.segment.index.entries()[0].tokens
        turn = request("c", [*saved, 1, 2, 3])
        finish(s, ctx, turn)  # its room evicts b, whose save evicts a's entry from the one-entry store
        assert not turn.is_restored and turn.n_reused == 0 and turn.output_ids
        assert store.segment.index.entries()[0].tokens[0] == 200  # the store holds b now
    finally:
        store.segment.close()
        arena.close()


def test_a_worker_whose_controller_died_unlinks_its_store_segment():
    book = StoreBook({"colocated": 1 << 20})
    (name,) = book.segments["colocated"].names
    store = ContextStore(FakeContext(FakeModel(), n_ctx=64, n_batch=64, n_seq_max=1, n_threads=1), [].append,
                         "f" * 64, lambda: None)
    store.attach(book.attach_message("colocated"))
    store.abandon()  # what the worker loop does when its controller is gone
    assert not os.path.exists(f"/dev/shm/{name}") and store.n_entries == 0
    book.close()  # the owner's close after that is harmless


def three_chats_and_a_document_part_way(s: Scheduler, ctx: FakeContext):
    """Three chats decoding and a 300-token background document (served after every interactive prompt)
    stepped until 100 of its tokens are computed: the document."""
    chats = [request(f"chat-{i}", range(1000 * (i + 1), 1000 * (i + 1) + 5), max_tokens=40) for i in range(3)]
    doc = request("doc", range(5000, 5300), max_tokens=2)
    doc.request_class = "background"
    for q in (*chats, doc):
        s.add(q)
    while doc.n_prefilled < 100:
        step(s, ctx)
    return doc


def test_a_prefill_gives_its_id_to_an_interactive_prompt_ahead_and_takes_back_what_it_computed(store_and_scheduler):
    s, ctx, store, sent, book = store_and_scheduler
    doc = three_chats_and_a_document_part_way(s, ctx)
    assert len(s.running) == 4 and not s.allocator.free_seq_ids and doc.is_prefilling  # every id held
    computed = doc.n_prefilled
    before = s.prefixes.stats()
    turn = request("turn", range(9000, 9010), max_tokens=2)
    s.add(turn)
    plan = step(s, ctx)
    assert plan.paused == (doc,) and doc.seq_id is None and doc.n_expected_reuse == computed
    assert [sl.seq for sl in plan.prefill] == [turn]  # admitted at once, in the id the doc gave back
    # its KV went to the store when the turn's admission took its id, and comes back from there: nothing recomputed
    plans = []
    while not doc.is_finished:
        plans.append(step(s, ctx))
    resumed = next(sl for p in plans for sl in p.prefill if sl.seq is doc)
    assert doc.n_reused == computed == resumed.start and doc.is_restored
    assert sum(sl.n_tokens for p in plans for sl in p.prefill if sl.seq is doc) == doc.n_prompt - computed
    # counted as a pause and its resume, not as a prompt looked up and served from the cache or the store
    after = s.prefixes.stats()
    assert (after.n_pauses, after.n_pause_resumed_tokens) == (1, computed)
    turn_lookup = len(turn.prompt_ids)
    assert (after.n_lookups, after.n_lookup_tokens) == (before.n_lookups + 1, before.n_lookup_tokens + turn_lookup)
    assert (after.n_hits, after.n_hit_tokens, after.n_store_hits, after.n_store_hit_tokens) == \
        (before.n_hits, before.n_hit_tokens, before.n_store_hits, before.n_store_hit_tokens)


def test_with_cached_ids_a_paused_prefill_stays_in_the_context_and_resumes_without_the_store():
    with store_scheduler(400, n_cached_ids=4) as (s, ctx, store, sent, book):
        doc = three_chats_and_a_document_part_way(s, ctx)
        assert len(s.running) == 4 and s.allocator.free_seq_ids  # ids are free, but four sequences run
        computed, doc_id = doc.n_prefilled, doc.seq_id
        turn = request("turn", range(9000, 9010), max_tokens=2)
        s.add(turn)
        plan = step(s, ctx)
        assert plan.paused == (doc,) and [sl.seq for sl in plan.prefill] == [turn]
        assert turn.seq_id != doc_id and s.allocator.n_cached == 1  # the turn ran under a cached-prefix id...
        assert ctx._seqs[doc_id] == doc.prompt_ids[:computed]  # ...and the document's KV stayed where it was
        plans = []
        while not doc.is_finished:
            plans.append(step(s, ctx))
        resumed = next(sl for p in plans for sl in p.prefill if sl.seq is doc)
        assert resumed.start == computed == doc.n_reused and not doc.is_restored
        assert doc.seq_id == doc_id  # it took its own id back
        # no save, no restore: the store was never touched
        assert not [m for m in sent if isinstance(m, StoreSaved)] and store.n_entries == 0 and store.busy_ms == 0
        assert s.prefixes.stats().n_pause_resumed_tokens == computed


def test_without_a_store_a_prefill_keeps_its_id_and_the_prompt_ahead_waits():
    from test_prefixreuse import make
    s, ctx = make(n_ctx=1024, n_seq_max=4, max_cached_cells=512)
    doc = three_chats_and_a_document_part_way(s, ctx)
    s.add(request("turn", range(9000, 9010), max_tokens=2))
    plan = step(s, ctx)  # without a store an evicted pause would be lost work: the doc goes on
    assert plan.paused == () and any(sl.seq is doc for sl in plan.prefill) and s.waiting[0].request_id == "turn"


def test_a_cached_entry_trimmed_for_a_shorter_match_is_saved_to_the_store_first():
    with store_scheduler(400) as (s, ctx, store, sent, book):  # a's whole conversation fits the context's cache
        head = list(range(10, 40))  # a shared system prompt
        a_tokens = [*head, *range(100, 170)]
        finish(s, ctx, request("a", a_tokens))  # a's conversation stays cached in the context
        assert s.allocator.n_cached == 1 and not sent
        for i in range(3):  # every other id held by running streams: the next prompt must take a's id
            s.add(request(f"x{i}", range(2000 + 100 * i, 2000 + 100 * i + 5), max_tokens=50))
        step(s, ctx)
        b = request("b", [*head, *range(300, 320)])
        s.add(b)
        step(s, ctx)
        assert b.n_reused == len(head)  # it took the shared head, trimming a's entry
        (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
        assert saved.tokens[:len(a_tokens)] == tuple(a_tokens)  # a's conversation is in the store, whole


@pytest.mark.parametrize("where", ["admission", "a request's end"])
@pytest.mark.parametrize("save_ms", [0.0, 150.0])
def test_a_step_after_a_save_gives_up_the_prompt_tokens_the_save_took(save_ms, where):
    """Streams wait for a save made between two steps as for a step, whether a prompt's admission took an
    entry's id or a request that ended kept its prefix over another: the next step is shorter by what the
    save took (without flash attention a long conversation's save takes 100-200 ms on a CPU)."""
    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=2.0, ms_per_decode_token=1.0, ms_per_kv_ktoken=0.0,
                       n_steps=50, error_ms=0.0)
    policy = StepPolicy(chunk=64, n_batch=64, itl_budget_ms=100.0, estimate=lambda: est)
    with store_scheduler(200 if where == "admission" else 100, policy) as (s, ctx, store, sent, _):
        now = [0.0]
        store.clock = lambda: now[0]
        get = ctx.state_get

        def slow_get(seq_id, view):
            now[0] += save_ms / 1e3
            return get(seq_id, view)

        ctx.state_get = slow_get
        finish(s, ctx, request("a", range(10, 90)))  # cached: 83 cells under one id
        streams = [request(f"s{i}", range(300 + 10 * i, 308 + 10 * i), max_tokens=50) for i in range(3)]
        if where == "a request's end":
            streams[0] = request("s0", range(100, 170), max_tokens=4)  # ends soon, keeping 73 cells: a goes
        for q in streams:
            s.add(q)
        while any(q.is_prefilling or q.seq_id is None for q in streams):
            step(s, ctx)
        if where == "a request's end":
            while not streams[0].is_finished:
                step(s, ctx)
            streams = streams[1:]
            assert [m for m in sent if isinstance(m, StoreSaved)]  # saved as s0 ended, before the next plan
        turn = request("b", range(500, 540))
        s.add(turn)
        full = policy.budget(streams)  # what the step would carry after no save
        plan = s.schedule()
        assert [m for m in sent if isinstance(m, StoreSaved)] and store.busy_ms == save_ms  # a went to the store
        assert plan.store_ms == save_ms  # the step log says what the streams waited for before it
        (sl,) = plan.prefill
        assert sl.seq is turn
        if save_ms:
            assert sl.n_tokens == max(1, full - policy.tokens_in_ms(save_ms)) == 1
        else:
            assert sl.n_tokens == full > 1


@pytest.mark.parametrize("case", ["no stream decodes", "streams decode", "its deadline needs it"])
def test_a_restore_longer_than_the_streams_gap_room_is_prefilled_instead_unless_the_deadline_needs_it(case):
    """A restore runs between two steps, and every decoding stream waits for it: while interactive streams are
    within their gap budget, one longer than what a step beside them leaves of the ITL budget is not made (the
    prompt is prefilled in budgeted steps), unless prefilling would miss the prompt's TTFT deadline."""
    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=5.0, ms_per_decode_token=1.0, ms_per_kv_ktoken=0.0,
                       n_steps=50, error_ms=0.0)
    policy = StepPolicy(chunk=64, n_batch=64, itl_budget_ms=100.0, estimate=lambda: est)
    with store_scheduler(100, policy) as (s, ctx, store, sent, book):
        finish(s, ctx, request("a", range(10, 90)))
        finish(s, ctx, request("b", range(200, 280)))  # over the 100 cached cells: a's entry goes to the store
        (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
        store.restore_ms_per_token = 2.0  # 83 tokens: a 166 ms restore, against 415 ms of prefill
        streams = [] if case == "no stream decodes" else \
            [request(f"s{i}", range(300 + 10 * i, 308 + 10 * i), max_tokens=50) for i in range(3)]
        for q in streams:
            s.add(q)
        while any(q.is_prefilling or q.seq_id is None for q in streams):
            step(s, ctx)
        turn = request("c", [*saved.tokens, 1, 2, 3])
        turn.deadline_s = 0.3 if case == "its deadline needs it" else 60.0  # 90 prompt tokens: ~2 s at the budget
        s.add(turn)
        room = policy.restore_limit_ms(turn, [q for q in streams if not q.is_prefilling], 0.0)
        plan = s.schedule(0.0)
        (sl,) = plan.prefill
        assert sl.seq is turn
        if case == "streams decode":
            assert room is not None and 0 < room < 166  # what a step beside three decodes leaves of 85 ms
            assert not turn.is_restored and sl.start == 0 and sl.n_tokens < turn.n_prompt
            assert s.prefixes.stats().n_store_hits == 0 and store.peek(turn.prompt_ids, ReuseMode.PREFIX, 1000)
        else:
            assert room is None
            assert turn.is_restored and sl.start == len(saved.tokens) and s.prefixes.stats().n_store_hits == 1


@pytest.mark.parametrize("streams_decode", [True, False])
def test_a_finished_entrys_save_longer_than_the_streams_gap_room_is_not_made_while_they_decode(streams_decode):
    """A save runs between two steps as a restore does: while interactive streams are within their gap budget, a
    finished sequence's entry whose save would take longer than their room is dropped from the context unsaved
    (counted), and saved as before when no stream waits on it."""
    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=5.0, ms_per_decode_token=1.0, ms_per_kv_ktoken=0.0,
                       n_steps=50, error_ms=0.0)
    policy = StepPolicy(chunk=64, n_batch=64, itl_budget_ms=100.0, estimate=lambda: est)
    with store_scheduler(100, policy) as (s, ctx, store, sent, _):
        finish(s, ctx, request("a", range(10, 90)))  # cached: 83 cells
        store.save_base_ms, store.save_ms_per_token = 0.0, 2.0  # its save: 166 ms
        streams = [request(f"s{i}", range(300 + 10 * i, 308 + 10 * i), max_tokens=50) for i in range(3)] \
            if streams_decode else []
        for q in streams:
            s.add(q)
        while any(q.is_prefilling or q.seq_id is None for q in streams):
            step(s, ctx)
        b = request("b", range(200, 280), max_tokens=2)
        s.add(b)
        while not b.is_finished:  # b's prefix kept over the 100 cached cells: a's entry leaves the context
            step(s, ctx)
        saved = [m for m in sent if isinstance(m, StoreSaved)]
        assert s.prefixes.index.longest_match(list(range(10, 90)), ReuseMode.PREFIX, 1000) is None
        if streams_decode:
            assert 0 < s.prefixes.save_limit_ms < 166 and not saved and s.prefixes.n_unsaved == 1
        else:
            assert s.prefixes.save_limit_ms is None and len(saved) == 1 and s.prefixes.n_unsaved == 0


@contextlib.contextmanager
def saves_taking_50_ms():
    """``store_scheduler`` (100 cached cells) stepping by an adaptive policy with a 100 ms ITL budget on a fixed
    step model, whose store's every save takes 50 ms by its clock: (scheduler, context, store, sent, policy)."""
    est = StepEstimate(base_ms=10.0, ms_per_prompt_token=5.0, ms_per_decode_token=1.0, ms_per_kv_ktoken=0.0,
                       n_steps=50, error_ms=0.0)
    policy = StepPolicy(chunk=64, n_batch=64, itl_budget_ms=100.0, estimate=lambda: est)
    now = [0.0]
    with store_scheduler(100, policy, clock=lambda: now[0]) as (s, ctx, store, sent, _):
        saving = store.segment.save

        def save(*args, **kw):
            now[0] += 0.050
            return saving(*args, **kw)

        store.segment.save = save
        yield s, ctx, store, sent, policy


@pytest.mark.parametrize("streams_decode", [True, False])
def test_saves_between_two_steps_share_the_streams_gap_room_and_one_past_it_is_not_made(streams_decode):
    """Two requests end in one step, and keeping each one's prefix evicts an older entry to the store: the streams
    wait for both saves before their next step, so the second is made only if the room the first left holds it.
    # why: each save was held to the whole room on its own, and between two steps they add up in one gap"""
    with saves_taking_50_ms() as (s, ctx, store, sent, policy):
        finish(s, ctx, request("old", range(10, 90)))     # cached: 83 of the 100 cells
        stream = request("s", range(300, 308), max_tokens=50)
        a, b = request("a", range(200, 270), max_tokens=50), request("b", range(400, 470), max_tokens=50)
        a.request_class = b.request_class = RequestClass.BACKGROUND  # no stream of their own to wait for saves
        for q in ([stream] if streams_decode else []) + [a, b]:
            s.add(q)
        while a.is_prefilling or b.is_prefilling or a.seq_id is None or b.seq_id is None:
            step(s, ctx)
        room = policy.store_room_ms([q for q in s.running if not q.is_prefilling])
        s.release(a, keep_prefix=True)   # over the 100 cells: "old" goes to the store (50 ms)
        s.release(b, keep_prefix=True)   # ... and then a's entry (another 50 ms)
        saved = [m.tokens[0] for m in sent if isinstance(m, StoreSaved)]
        if streams_decode:
            assert room is not None and 50 < room < 100   # one save fits the room, two do not
            assert saved == [10] and s.prefixes.n_unsaved == 1
            # what is left for the stream after both: its room beside it alone, less the save made
            assert s.prefixes.save_limit_ms == pytest.approx(policy.store_room_ms([stream]) - 50, abs=1e-6)
        else:
            assert room is None and saved == [10, 200] and s.prefixes.n_unsaved == 0


def test_a_restore_after_saves_that_made_room_for_it_fits_what_they_left_of_the_streams_gap_room():
    """Admitting a prompt from the store first evicts a cached entry to free its id (a save the streams wait for),
    then restores: the restore is made only if it fits the room that save left, else the prompt is prefilled."""
    with saves_taking_50_ms() as (s, ctx, store, sent, policy):
        finish(s, ctx, request("a", range(10, 90)))
        finish(s, ctx, request("b", range(200, 280)))  # over the 100 cached cells: a's entry goes to the store
        (saved,) = [m for m in sent if isinstance(m, StoreSaved)]
        store.restore_ms_per_token = 0.5  # 83 tokens: a 41.5 ms restore, against 415 ms of prefill
        streams = [request(f"s{i}", range(300 + 10 * i, 308 + 10 * i), max_tokens=50) for i in range(3)]
        for q in streams:
            s.add(q)
        while any(q.is_prefilling or q.seq_id is None for q in streams):
            step(s, ctx)
        turn = request("c", [*saved.tokens, 1, 2, 3])
        turn.deadline_s = 60.0   # far: the restore is held to the streams' room
        s.add(turn)
        room = policy.restore_limit_ms(turn, streams, 0.0)
        assert 41.5 < room < 41.5 + 50   # the restore alone fits; after b's entry's 50 ms save it does not
        plan = s.schedule(0.0)
        (sl,) = plan.prefill
        assert sl.seq is turn and [m.tokens[0] for m in sent if isinstance(m, StoreSaved)] == [10, 200]
        assert not turn.is_restored and sl.start == 0 and s.prefixes.stats().n_store_hits == 0
