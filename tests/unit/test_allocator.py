"""Sequence ids and KV cells of one context, without a scheduler or a model."""
from __future__ import annotations

import pytest

from homepd.core.allocator import KVAllocator


def test_sequence_ids_are_handed_out_lowest_first_and_a_freed_one_is_reused_first():
    a = KVAllocator(n_seq_max=3, n_ctx=100)
    assert [a.allocate(10), a.allocate(10)] == [0, 1]
    a.free(0)
    assert a.allocate(10) == 0
    assert a.allocate(10) == 2


def test_no_free_sequence_id_means_no_allocation_whatever_the_cells():
    a = KVAllocator(n_seq_max=2, n_ctx=1000)
    a.allocate(1)
    a.allocate(1)
    assert not a.can_allocate(0) and a.n_cells_free == 998


def test_cells_are_reserved_up_to_n_ctx_exactly():
    a = KVAllocator(n_seq_max=4, n_ctx=100)
    a.allocate(60)
    assert a.can_allocate(40) and not a.can_allocate(41)
    a.allocate(40)
    assert a.n_cells_reserved == 100 and a.n_cells_free == 0 and not a.can_allocate(1)


def test_free_gives_back_the_cells_that_sequence_reserved():
    a = KVAllocator(n_seq_max=4, n_ctx=100)
    big, small = a.allocate(70), a.allocate(20)
    a.free(big)
    assert a.n_cells_reserved == 20 and a.can_allocate(80)
    a.free(small)
    assert a.n_cells_reserved == 0 and sorted(a.free_seq_ids) == [0, 1, 2, 3]


def test_allocate_refuses_what_does_not_fit():
    a = KVAllocator(n_seq_max=1, n_ctx=10)
    with pytest.raises(AssertionError):
        a.allocate(11)


def test_freeing_an_id_twice_is_a_bug():
    a = KVAllocator(n_seq_max=2, n_ctx=10)
    seq_id = a.allocate(5)
    a.free(seq_id)
    with pytest.raises(AssertionError):
        a.free(seq_id)
    assert a.n_cells_reserved == 0 and len(a.free_seq_ids) == 2


def test_a_reservation_grows_while_the_cells_are_there_and_never_shrinks():
    a = KVAllocator(n_seq_max=2, n_ctx=100)
    first, second = a.allocate(16), a.allocate(64)
    assert a.can_grow(first, 36) and not a.can_grow(first, 37)
    a.grow(first, 32)
    assert a.n_cells_of(first) == 32 and a.n_cells_reserved == 96 and a.n_cells_free == 4
    with pytest.raises(AssertionError):
        a.grow(first, 16)  # shrinking is not growing
    with pytest.raises(AssertionError):
        a.grow(second, 69)  # past n_ctx
    a.free(first)
    assert a.n_cells_reserved == 64 and a.can_grow(second, 100)


def test_cached_ids_hold_finished_sequences_but_never_a_running_one_past_n_seq_max():
    a = KVAllocator(n_seq_max=2, n_ctx=1000, n_cached_ids=2)
    assert a.n_ids == 4
    first, second = a.allocate(10), a.allocate(10)
    assert a.n_running == 2 and a.free_seq_ids  # two ids are free, but two sequences already run
    assert not a.can_allocate(1) and not a.can_allocate_evicting(1) and not a.can_allocate_sharing(10, 5)
    assert not a.id_available
    with pytest.raises(AssertionError):
        a.allocate(1)
    a.cache(first, 10)  # it finished: its KV stays, and another sequence may run under a free id
    assert a.n_running == 1 and a.id_available and a.can_allocate(1)
    third = a.allocate(10)
    assert third not in (first, second) and a.n_cached == 1
    assert not a.can_take(first, 10)  # the cached one may not run again while two do
    a.free(second)
    assert a.can_take(first, 10)
    a.take(first, 10)
    assert a.n_running == 2 and a.n_cached == 0


def test_without_cached_ids_a_cached_sequence_holds_one_of_the_running_ids():
    a = KVAllocator(n_seq_max=2, n_ctx=1000)
    first = a.allocate(10)
    a.allocate(10)
    a.cache(first, 10)
    assert not a.free_seq_ids and a.id_available  # its id comes back only by evicting it
    assert not a.can_allocate(1) and a.can_allocate_evicting(1)


def test_streams_cap_each_id_at_its_stream_whatever_the_pool_has_free():
    a = KVAllocator(n_seq_max=2, n_ctx=1000, stream_cells=500)
    assert a.can_allocate(500) and not a.can_allocate(501)  # the pool has 1,000 free, a stream 500
    assert not a.can_allocate_evicting(501) and not a.can_allocate_sharing(501, 10)
    first = a.allocate(400)
    assert a.can_grow(first, 500) and not a.can_grow(first, 501)
    a.cache(first, 400)
    assert a.can_take(first, 500) and not a.can_take(first, 501)
    a.take(first, 500)
    second = a.allocate(500)  # the other stream is whole: the pool's count agrees
    assert a.n_cells_free == 0 and second != first


def test_a_unified_pool_lets_one_id_fill_it():
    a = KVAllocator(n_seq_max=2, n_ctx=1000)
    assert a.stream_cells is None and a.can_allocate(1000) and a.fits_stream(10**6)


def test_streams_cannot_add_up_to_more_than_the_context():
    with pytest.raises(AssertionError):
        KVAllocator(n_seq_max=2, n_ctx=1000, n_cached_ids=1, stream_cells=500)  # three ids of 500
