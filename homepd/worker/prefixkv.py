"""The prefix cache's hands on a worker's context (``homepd.core.prefixreuse.KVOps``)."""
from __future__ import annotations


class ContextKV:
    """The prefix cache's hands on the context (``homepd.core.prefixreuse.KVOps``).

    ``fault="reuse_off_by_one"`` (test-only) copies or keeps one cell past the matched prefix: the request
    then holds, at the position where its prompt parts from the cached sequence, that sequence's token
    instead of its own (and computes its own token at the next position)."""

    def __init__(self, ctx, fault: str | None = None):
        self.ctx, self.fault = ctx, fault
        self.can_share = ctx.can_share

    def drop(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id)

    def copy(self, src_id: int, dst_id: int, n_cells: int) -> int:
        if self.fault == "reuse_off_by_one":
            n_cells += 1
        return self.ctx.seq_copy(src_id, dst_id, n_cells)

    def trim(self, seq_id: int, n_keep: int) -> int | None:
        if self.fault == "reuse_off_by_one":
            n_keep += 1
        return self.ctx.seq_trim(seq_id, n_keep)
