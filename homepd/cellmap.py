"""Where llama.cpp puts each token's KV cell in a unified cache, mirrored: what a step's attention costs.

Without flash attention, llama.cpp multiplies every query of a step by the cache's *used range*, its cells
up to the highest one in use (``llama_kv_cache::get_n_kv``: ``used_max_p1`` padded up to 256), masked where
a cell is not the query's sequence's.  A hole below the highest cell costs as much as a cell in use:
``benchmarks/kv_range.py`` ran two decodes of 400 cells each in 24.3 ms at the bottom of the cache and in
37.0 ms with the same 800 cells above a 2,000-cell hole.  No llama.cpp call reports the range, so this
mirrors the placement (``find_slot``, ``apply_ubatch``, ``seq_rm``, ``seq_cp``) from the same events:

* a step's tokens (decodes first, then the prompt slices, the batch's order) take free cells one at a time
  from the head, wrapping round; the head starts again at cell 0 when the cells below it could hold the
  batch twice over (more than ``2 * n_tokens`` free there), and moves past the last cell taken;
* a sequence imported whole (``llama_state_seq_set_data``: the KV store's restore, a hand-off) takes its cells
  the same way (``state_read_meta`` calls ``find_slot(ubatch, false)``: not one contiguous run);
* removing a sequence's positions from ``n`` on frees the cells no other sequence holds, and moves the head
  down to the lowest one freed;
* a copy of a sequence's first positions adds the new id to those cells (nothing is copied).

Pure bookkeeping over bytearrays (``find`` walks them in C), no policy: the scheduler drives it beside the
allocator, whose counts of cells stay the admission's (``homepd.core.allocator``).
"""
from __future__ import annotations

N_PAD = 256  # get_n_kv pads the range to at least 256 cells, and to a multiple of 256


def attended_cells(n_cells: int, n_seqs: int, streams: bool, idle_cells: int = 0, flash_attn: bool = False) -> int:
    """The KV cells each token of a step attends over, counted without the map: ``n_cells`` held by ``n_seqs``
    running sequences and ``idle_cells`` by cached prefixes no running sequence shares.  On a unified cache the
    running ones', and without flash attention the idle ones' too (a lower bound of the used range, which only
    a worker's own ``CellMap`` knows: the controller's gate prices with this); on a split cache
    (``--kv-layout streams``) only its own sequence's, taken as their mean.

    # why the idle cells: left out, a decode step beside ~1,000 idle cells cost 30-40 % more than a step of the
    # same shape and running cells priced (benchmarks/kv_layout.py: 19.0 -> 24.6 ms with 3,360 idle cells)"""
    if streams:
        return n_cells // max(1, n_seqs)
    return n_cells if flash_attn else n_cells + idle_cells


_INC = bytes(min(i + 1, 255) for i in range(256))
_DEC = bytes(max(i - 1, 0) for i in range(256))
_HELD = bytes([0] + [1] * 255)


class CellMap:
    """The cells of one unified cache of ``n_cells`` and, per sequence id, the cells of its positions in order."""

    def __init__(self, n_cells: int):
        assert n_cells >= 1
        self.n_cells = n_cells
        self._holders = bytearray(n_cells)  # how many ids hold each cell
        self._held = bytearray(n_cells)  # 1 where any id does (what ``find`` searches)
        self._runs: dict[int, list[tuple[int, int]]] = {}  # id -> its cells as runs [start, stop), in position order
        self._n_of: dict[int, int] = {}  # id -> how many (read per running sequence per plan)
        self.n_used = 0
        self.head = 0

    def n_of(self, seq_id: int) -> int:
        """Positions (cells) ``seq_id`` holds."""
        return self._n_of.get(seq_id, 0)

    @property
    def used_max(self) -> int:
        """One past the highest cell in use (llama.cpp's ``used_max_p1``)."""
        return self._held.rfind(1) + 1

    def attended(self, n_tokens: int = 0) -> int:
        """The cells each query of a step attends over once its ``n_tokens`` are placed: the used range, padded
        as ``get_n_kv`` pads it."""
        top = self.used_max
        if n_tokens:
            runs = self._free_runs(n_tokens)
            if runs:
                top = max(top, max(stop for _, stop in runs))
        return min(self.n_cells, max(N_PAD, -(-top // N_PAD) * N_PAD))

    def place(self, tokens: list[tuple[int, int]]) -> None:
        """One batch: ``(seq_id, n)`` in the batch's order, each sequence's next ``n`` positions.  Tokens beyond
        the free cells are left out."""
        n_tokens = sum(n for _, n in tokens)
        if n_tokens <= 0:
            return
        runs = self._free_runs(n_tokens)
        for seq_id, n in tokens:
            mine = self._runs.setdefault(seq_id, [])
            while n > 0 and runs:
                start, stop = runs[0]
                take = min(n, stop - start)
                self._hold(start, start + take)
                if mine and mine[-1][1] == start:
                    mine[-1] = (mine[-1][0], start + take)
                else:
                    mine.append((start, start + take))
                self.head = start + take
                self._n_of[seq_id] = self._n_of.get(seq_id, 0) + take
                n -= take
                runs[0] = (start + take, stop)
                if runs[0][0] == stop:
                    runs.pop(0)

    def keep(self, seq_id: int, n: int = 0) -> None:
        """``seq_id`` keeps its first ``n`` positions (``seq_rm(seq_id, n, -1)``; 0: it is gone)."""
        runs = self._runs.get(seq_id)
        if not runs:
            return
        kept: list[tuple[int, int]] = []
        lowest_freed = self.n_cells
        for start, stop in runs:
            if n >= stop - start:
                kept.append((start, stop))
                n -= stop - start
                continue
            if n > 0:
                kept.append((start, start + n))
                start, n = start + n, 0
            lowest_freed = min(lowest_freed, self._release(start, stop))
        if kept:
            self._runs[seq_id] = kept
            self._n_of[seq_id] = sum(stop - start for start, stop in kept)
        else:
            del self._runs[seq_id], self._n_of[seq_id]
        if lowest_freed < self.head:
            self.head = lowest_freed

    def share(self, src_id: int, dst_id: int, n: int) -> None:
        """``dst_id`` (holding nothing) gets ``src_id``'s first ``n`` positions' cells (``seq_cp``)."""
        self.keep(dst_id)
        copied: list[tuple[int, int]] = []
        for start, stop in self._runs.get(src_id, ()):
            if n <= 0:
                break
            stop = min(stop, start + n)
            n -= stop - start
            self._holders[start:stop] = self._holders[start:stop].translate(_INC)
            copied.append((start, stop))
        if copied:
            self._runs[dst_id] = copied
            self._n_of[dst_id] = sum(stop - start for start, stop in copied)

    def _hold(self, start: int, stop: int) -> None:
        self._holders[start:stop] = self._holders[start:stop].translate(_INC)
        self._held[start:stop] = b"\x01" * (stop - start)
        self.n_used += stop - start

    def _release(self, start: int, stop: int) -> int:
        """One holder fewer on ``[start, stop)``; returns the lowest cell that became free (``n_cells``: none)."""
        left = self._holders[start:stop].translate(_DEC)
        self._holders[start:stop] = left
        held = left.translate(_HELD)
        freed = held.find(0)
        self.n_used -= (stop - start) - sum(held)
        self._held[start:stop] = held
        return self.n_cells if freed < 0 else start + freed

    def _free_runs(self, n_tokens: int) -> list[tuple[int, int]]:
        """The free cells ``find_slot`` would give ``n_tokens``, as runs in the order taken (nothing is held):
        one circle from the head, one cell at a time."""
        head = 0 if self.head > self.n_used + 2 * n_tokens else self.head
        held, size = self._held, self.n_cells
        runs: list[tuple[int, int]] = []
        need = n_tokens
        for lo, hi in ((head, size), (0, head)):
            at = lo
            while need > 0 and at < hi:
                i = held.find(0, at, hi)
                if i < 0:
                    break
                j = held.find(1, i, hi)
                take = min(need, (hi if j < 0 else j) - i)
                runs.append((i, i + take))
                need -= take
                at = i + take
        return [] if need > 0 else runs
