"""Who holds what in one llama.cpp context: free sequence ids and reserved KV cells.

Pure bookkeeping, no policy: the scheduler decides how many cells a request
reserves and when it is admitted; the allocator only answers whether that fits
(a free sequence id and ``n_cells`` unreserved cells out of ``n_ctx``), hands
out the sequence id and takes it back with its cells.
"""
from __future__ import annotations


class KVAllocator:
    """``n_seq_max`` llama.cpp sequence ids over a unified KV cache of ``n_ctx`` cells."""

    def __init__(self, n_seq_max: int, n_ctx: int):
        assert n_seq_max >= 1 and n_ctx >= 1
        self.n_seq_max = n_seq_max
        self.n_ctx = n_ctx
        # why: a stack, lowest id on top, so ids are handed out 0, 1, 2… and a freed id is reused first
        self.free_seq_ids: list[int] = list(range(n_seq_max - 1, -1, -1))
        self.n_cells_reserved = 0
        self._n_cells_of: list[int | None] = [None] * n_seq_max  # cells reserved by each allocated id

    @property
    def n_cells_free(self) -> int:
        return self.n_ctx - self.n_cells_reserved

    def can_allocate(self, n_cells: int) -> bool:
        """True if a sequence id is free and ``n_cells`` more cells fit in ``n_ctx``."""
        return bool(self.free_seq_ids) and self.n_cells_reserved + n_cells <= self.n_ctx

    def allocate(self, n_cells: int) -> int:
        """Reserve ``n_cells`` cells under a free sequence id and return that id."""
        assert n_cells >= 0 and self.can_allocate(n_cells)
        seq_id = self.free_seq_ids.pop()
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells
        return seq_id

    def free(self, seq_id: int) -> None:
        """Give back ``seq_id`` and the cells it reserved."""
        n_cells = self._n_cells_of[seq_id]
        assert n_cells is not None, f"sequence id {seq_id} is not allocated"
        self._n_cells_of[seq_id] = None
        self.n_cells_reserved -= n_cells
        self.free_seq_ids.append(seq_id)
