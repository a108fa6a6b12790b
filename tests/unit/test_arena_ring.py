"""The KV arena's allocator (pure): ring order, wrap-around, out-of-order frees, back-pressure."""
from __future__ import annotations

import random

import pytest

from homepd.kv.ring import PAGE_BYTES, RingAllocator

P = PAGE_BYTES


def test_extents_are_whole_pages_and_follow_each_other():
    ring = RingAllocator(16 * P)
    assert ring.extent_bytes(1) == P and ring.extent_bytes(P) == P and ring.extent_bytes(P + 1) == 2 * P
    assert [ring.alloc(n) for n in (P, 3 * P - 5, 2 * P)] == [0, P, 4 * P]
    assert ring.used_bytes == 6 * P and ring.live == {0: P, P: 3 * P, 4 * P: 2 * P}
    ring.check()


def test_fifo_handoffs_go_round_the_ring_and_wrap_to_the_start():
    ring = RingAllocator(10 * P)
    a, b, c = ring.alloc(4 * P), ring.alloc(4 * P), None
    assert (a, b) == (0, 4 * P)
    assert ring.alloc(4 * P) is None        # 2 pages left at the end: back-pressure
    ring.free(a)                            # the oldest is imported first
    c = ring.alloc(4 * P)                   # no room after the head: wraps to the start
    assert c == 0
    ring.free(b)
    d = ring.alloc(3 * P)                   # the head is after c: the ring goes on from there
    assert d == 4 * P
    ring.free(c)
    e = ring.alloc(2 * P)                   # still from the head on, not back at 0
    assert e == 7 * P
    ring.check()
    assert ring.peak_used_bytes == 8 * P


def test_an_out_of_order_free_leaves_a_hole_that_is_merged_and_reused():
    ring = RingAllocator(12 * P)
    a, b, c = (ring.alloc(4 * P) for _ in range(3))
    ring.free(b)                            # a cancel in the middle
    ring.check()
    assert ring.largest_free_bytes == 4 * P
    assert ring.alloc(5 * P) is None        # a 4-page hole does not hold 5 pages
    ring.free(a)                            # merged with the hole: 8 pages at the start
    assert ring.largest_free_bytes == 8 * P
    assert ring.alloc(5 * P) == 0
    ring.free(c)
    ring.check()
    assert ring.used_bytes == 5 * P


def test_a_full_arena_takes_a_request_of_the_whole_capacity_once_empty():
    ring = RingAllocator(8 * P)
    assert ring.can_ever_fit(8 * P) and not ring.can_ever_fit(8 * P + 1)
    small = ring.alloc(P)
    assert ring.alloc(8 * P) is None        # waits: it can fit, just not now
    ring.free(small)
    assert ring.alloc(8 * P) == 0           # whole arena, although the head had moved on
    assert ring.alloc(1) is None


def test_max_extents_bounds_the_handoffs_in_flight():
    ring = RingAllocator(64 * P, max_extents=2)
    a, _ = ring.alloc(P), ring.alloc(P)
    assert ring.alloc(P) is None and ring.free_bytes == 62 * P
    ring.free(a)
    assert ring.alloc(P) is not None


def test_reserve_rebuilds_the_live_extents_of_a_previous_allocator():
    before = RingAllocator(20 * P)
    live = [before.alloc(n * P) for n in (3, 5, 2)]
    before.free(live[0])
    rebuilt = RingAllocator(20 * P)
    for offset in live[1:]:
        rebuilt.reserve(offset, before.length_of(offset))
    assert rebuilt.live == before.live and rebuilt.used_bytes == before.used_bytes
    rebuilt.check()
    with pytest.raises(AssertionError, match="is not free"):
        rebuilt.reserve(live[1], P)
    assert rebuilt.alloc(3 * P) == 0        # the freed extent's bytes are free in the rebuilt one


@pytest.mark.parametrize("seed", range(20))
def test_concurrent_handoffs_never_overlap_and_every_byte_comes_back(seed):
    """Nearly-FIFO traffic with some out-of-order frees: exports of varied sizes, imports mostly oldest first."""
    rng = random.Random(seed)
    ring = RingAllocator(64 * P, max_extents=rng.choice([None, 4, 8]))
    in_flight: list[int] = []
    waiting: list[int] = []                 # sizes that met back-pressure, retried in order
    for _ in range(400):
        if rng.random() < 0.55:
            waiting.append(rng.randint(1, 20 * P))
        if in_flight and rng.random() < 0.5:
            i = 0 if rng.random() < 0.85 else rng.randrange(len(in_flight))  # mostly FIFO
            ring.free(in_flight.pop(i))
        while waiting:
            offset = ring.alloc(waiting[0])
            if offset is None:
                break                       # back-pressure keeps the order: the oldest goes first
            waiting.pop(0)
            in_flight.append(offset)
        ring.check()
        spans = sorted((o, o + ring.length_of(o)) for o in in_flight)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for offset in in_flight:
        ring.free(offset)
    ring.check()
    assert ring.used_bytes == 0 and ring.largest_free_bytes == 64 * P
    assert ring.peak_used_bytes <= 64 * P
