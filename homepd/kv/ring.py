"""Which bytes of the KV arena are taken: extents handed out in ring order.

Pure bookkeeping, no shared memory and no clock: the prefill worker owns one
``RingAllocator`` over the arena's data region and asks it where the next
export goes; the arena itself (``homepd.kv.pool``) holds the bytes.

Handoffs are nearly FIFO — the prompt exported first is usually imported
first — so the allocator is a ring (next-fit): each extent starts where the
previous one ended, and when the end of the arena has no room the head wraps
to the start.  The oldest extents, the next to be freed, then sit just ahead
of the head.  A free out of order (a cancel, a refused import, a worker death)
leaves a hole, merged with its free neighbours and reused when the head comes
round or when nothing after the head fits.
"""
from __future__ import annotations

from bisect import bisect_left, insort

PAGE_BYTES = 4096


class RingAllocator:
    """Extents of ``capacity_bytes`` bytes, each a multiple of ``align_bytes``; at most ``max_extents`` live."""

    def __init__(self, capacity_bytes: int, align_bytes: int = PAGE_BYTES, max_extents: int | None = None):
        assert align_bytes >= 1 and capacity_bytes >= align_bytes and capacity_bytes % align_bytes == 0, \
            (capacity_bytes, align_bytes)
        assert max_extents is None or max_extents >= 1
        self.capacity_bytes = capacity_bytes
        self.align_bytes = align_bytes
        self.max_extents = max_extents
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, length), sorted, merged
        self._live: dict[int, int] = {}                             # offset -> length
        self.head = 0                                               # where the next search starts
        self.used_bytes = 0
        self.peak_used_bytes = 0

    # sizes ---------------------------------------------------------------------
    def extent_bytes(self, n_bytes: int) -> int:
        """What ``n_bytes`` take in the arena: rounded up to ``align_bytes``."""
        assert n_bytes >= 1
        return -(-n_bytes // self.align_bytes) * self.align_bytes

    def can_ever_fit(self, n_bytes: int) -> bool:
        """True if ``n_bytes`` fit an empty arena (else waiting for frees would never help)."""
        return self.extent_bytes(n_bytes) <= self.capacity_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return max((length for _, length in self._free), default=0)

    @property
    def live(self) -> dict[int, int]:
        """Live extents, offset -> length (a copy)."""
        return dict(self._live)

    def length_of(self, offset: int) -> int | None:
        return self._live.get(offset)

    # allocation ----------------------------------------------------------------
    def alloc(self, n_bytes: int) -> int | None:
        """Take an extent for ``n_bytes`` and return its offset; None when nothing fits now.

        None is back-pressure (wait for a free and retry) unless ``can_ever_fit`` is False.
        """
        size = self.extent_bytes(n_bytes)
        if self.max_extents is not None and len(self._live) >= self.max_extents:
            return None
        start = self._find(size)
        if start is None:
            return None
        self._take(start, size)
        self.head = start + size if start + size < self.capacity_bytes else 0
        return start

    def _find(self, size: int) -> int | None:
        # first from the head on (the ring), then from the start of the arena (the wrap)
        for begin, end in self._free_spans_from(self.head):
            if end - begin >= size:
                return begin
        for begin, length in self._free:
            if length >= size:
                return begin
        return None

    def _free_spans_from(self, position: int):
        for begin, length in self._free:
            if begin + length > position:
                yield max(begin, position), begin + length

    def reserve(self, offset: int, n_bytes: int) -> None:
        """Mark ``[offset, offset + extent_bytes(n_bytes))`` live: rebuilding after a restart from
        the extents another process still uses.  The range must be free."""
        size = self.extent_bytes(n_bytes)
        assert offset % self.align_bytes == 0, offset
        self._take(offset, size)

    def _take(self, start: int, size: int) -> None:
        i = bisect_left(self._free, (start + 1, 0)) - 1
        assert i >= 0, (start, size)
        begin, length = self._free[i]
        assert begin <= start and start + size <= begin + length, f"[{start}, {start + size}) is not free"
        del self._free[i]
        if start > begin:
            insort(self._free, (begin, start - begin))
        if start + size < begin + length:
            insort(self._free, (start + size, begin + length - start - size))
        self._live[start] = size
        self.used_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def free(self, offset: int) -> int:
        """Give back the extent at ``offset``; returns its length.  Merged with free neighbours."""
        size = self._live.pop(offset)
        self.used_bytes -= size
        begin, end = offset, offset + size
        i = bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == end:  # the next one is free: merge
            end += self._free[i][1]
            del self._free[i]
        if i > 0 and sum(self._free[i - 1]) == begin:        # the previous one is free: merge
            begin = self._free[i - 1][0]
            del self._free[i - 1]
        insort(self._free, (begin, end - begin))
        return size

    def check(self) -> None:
        """Assert the invariants: free and live extents tile the arena exactly, free ones merged."""
        spans = sorted([*self._free, *self._live.items()])
        position = 0
        for begin, length in spans:
            assert begin == position and length > 0, (begin, position, spans)
            position += length
        assert position == self.capacity_bytes
        assert all(a + la < b for (a, la), (b, _) in zip(self._free, self._free[1:])), self._free
        assert self.used_bytes == sum(self._live.values())
