"""Who holds what in one llama.cpp context: free sequence ids and reserved KV cells.

Pure bookkeeping, no policy: the scheduler decides how many cells a request
reserves, when it grows and who gives cells back (``homepd.core.kvpolicy``);
the allocator only answers whether that fits (a free sequence id and cells
unreserved out of ``n_ctx``), hands out the sequence id, grows a sequence's
reservation and takes the id back with its cells.

# why counting cells is enough: the context is one unified KV cache
# (``kv_unified``, homepd.llm), and llama.cpp finds a batch's cells, and an
# imported sequence's, anywhere in it (not contiguous), so n_ctx cells are
# one pool with no fragmentation to account for.
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

    def n_cells_of(self, seq_id: int) -> int:
        """Cells reserved under ``seq_id`` now."""
        n_cells = self._n_cells_of[seq_id]
        assert n_cells is not None, f"sequence id {seq_id} is not allocated"
        return n_cells

    def can_grow(self, seq_id: int, n_cells: int) -> bool:
        """True if ``seq_id``'s reservation can become ``n_cells`` (at least what it holds)."""
        return self.n_cells_reserved - self.n_cells_of(seq_id) + n_cells <= self.n_ctx

    def grow(self, seq_id: int, n_cells: int) -> None:
        """Make ``seq_id``'s reservation ``n_cells``; a reservation never shrinks while the id is held."""
        held = self.n_cells_of(seq_id)
        assert n_cells >= held and self.can_grow(seq_id, n_cells)
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells - held

    def free(self, seq_id: int) -> None:
        """Give back ``seq_id`` and the cells it reserved."""
        n_cells = self.n_cells_of(seq_id)
        self._n_cells_of[seq_id] = None
        self.n_cells_reserved -= n_cells
        self.free_seq_ids.append(seq_id)
