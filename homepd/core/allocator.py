"""Who holds what in one llama.cpp context: free sequence ids and reserved KV cells.

Pure bookkeeping, no policy: the scheduler decides how many cells a request reserves, when it grows and who gives
cells back (``homepd.core.kvpolicy``); the allocator only answers whether that fits (a free sequence id and cells
unreserved out of ``n_ctx``), hands out the sequence id, grows a sequence's reservation and takes the id back.

A finished sequence can stay *cached* (``homepd.core.prefixreuse``): its id and the cells its KV holds are counted
apart (``n_cells_cached``) until it is evicted (``uncache``) or a new request takes it over (``take``).  Cached
cells are reclaimable: ``can_allocate_evicting`` answers whether a request would fit once every cached sequence is
gone, so a cached prefix never blocks a request.

**Running and cached ids.**  At most ``n_run_limit`` ids run (hold a reservation) at once: ``n_seq_max``, which the
scheduler raises by up to ``n_prefill_ids`` while it starts prompts (a prompt beyond ``n_seq_max``);
``n_cached_ids`` more exist so that a cached prefix can keep its id while every running id is taken.  Which cached
entries may (paused prefills, which resume for certain) is the prefix cache's policy (``homepd.core.prefixreuse``).

# why: with as many ids as running requests, a prefill paused for a chat turn gave its id to it, so its KV went to
# the KV store and back; without flash attention (the CPU default) a save or restore of scattered cells takes
# 100-230 ms at 1 thread, during which every stream waits (a document was paused 15 times)

**Streams.**  With ``--kv-layout streams`` (``kv_unified`` off) llama.cpp gives each id its own stream of
``stream_cells`` = n_ctx / ids cells: a step's tokens attend only over their own sequence's stream, and no id may
hold more than one stream (``fits_stream``); the streams add up to the pool, so the pool's count holds too.  No
cells are shared across streams (llama.cpp copies whole streams only).

**Shared cells.**  A request can start from a copy of a cached sequence's first cells (``allocate_sharing``:
``llama_memory_seq_cp`` on a unified cache adds the new id to those cells, it copies nothing).  Each id then records
the one id it shares its first cells with and how many (a forest); a cell is counted once however many ids hold
it: cells in use = reserved + cached − shared.  When an id goes away or is trimmed, the ids sharing with it are
re-linked to what they still physically share.

**Where the cells are.**  Counting is enough to admit: llama.cpp finds a batch's cells, and an imported sequence's,
anywhere in a unified cache, so ``n_ctx`` cells are one pool.  Where they lie decides what a step costs, though (its
attention spans the used range, holes included): ``cells``, a ``homepd.cellmap.CellMap`` of a unified cache, follows
every id's cells as llama.cpp places them.
"""
from __future__ import annotations

from homepd.cellmap import CellMap


class KVAllocator:
    """``n_seq_max`` running sequences, ``n_prefill_ids`` more while prompts start (``n_ids`` llama.cpp sequence
    ids, with the cached ones), over a unified KV cache of ``n_ctx`` cells, or over one stream of ``stream_cells``
    per id (the pool's count still holds: the streams add up to at most ``n_ctx``)."""

    def __init__(self, n_seq_max: int, n_ctx: int, n_cached_ids: int = 0, stream_cells: int | None = None,
                 n_prefill_ids: int = 0):
        assert n_seq_max >= 1 and n_ctx >= 1 and n_cached_ids >= 0 and n_prefill_ids >= 0
        self.n_seq_max = n_seq_max
        self.n_prefill_ids = n_prefill_ids
        self.n_run_limit = n_seq_max  # the scheduler's to set, within n_seq_max + n_prefill_ids
        self.n_ids = n_seq_max + n_prefill_ids + n_cached_ids
        self.n_ctx = n_ctx
        # None: one unified pool; else each id's own stream of that many cells (``--kv-layout streams``), and no
        # id holds more whatever the pool has free
        assert stream_cells is None or 1 <= stream_cells * self.n_ids <= n_ctx
        self.stream_cells = stream_cells
        # why: a stack, lowest id on top, so ids are handed out 0, 1, 2… and a freed id is reused first
        self.free_seq_ids: list[int] = list(range(self.n_ids - 1, -1, -1))
        self.n_running = 0  # ids holding a reservation (allocated or taken, not yet cached or freed)
        self.n_cells_reserved = 0
        self._n_cells_of: list[int | None] = [None] * self.n_ids  # cells reserved by each allocated id
        self.n_cells_cached = 0
        self._n_cached_of: dict[int, int] = {}  # cached id -> the cells its KV holds
        self._shares: dict[int, tuple[int, int]] = {}  # id -> (id it shares its first cells with, how many)
        # its holders change here; the scheduler places each step's tokens
        self.cells = CellMap(n_ctx) if stream_cells is None else None

    @property
    def n_cells_shared(self) -> int:
        """Cells counted under two ids (once per extra holder)."""
        return sum(n for _, n in self._shares.values())

    @property
    def n_cells_in_use(self) -> int:
        """Cells reserved or cached, each counted once."""
        return self.n_cells_reserved + self.n_cells_cached - self.n_cells_shared

    @property
    def n_cells_cached_only(self) -> int:
        """Cells only cached sequences hold (a cell a running sequence also holds is counted as its)."""
        shares = self._shares_without(set(self._n_cached_of))
        return self.n_cells_in_use - (self.n_cells_reserved - sum(n for _, n in shares.values()))

    @property
    def n_cells_free(self) -> int:
        return self.n_ctx - self.n_cells_in_use

    @property
    def n_cached(self) -> int:
        return len(self._n_cached_of)

    def shares_of(self, seq_id: int) -> tuple[int, int] | None:
        """(the id ``seq_id`` shares its first cells with, how many), or None."""
        return self._shares.get(seq_id)

    @property
    def can_run_more(self) -> bool:
        """Fewer than ``n_run_limit`` sequences run."""
        return self.n_running < self.n_run_limit

    @property
    def id_available(self) -> bool:
        """A new request could run under an id now: fewer than ``n_run_limit`` run, and an id is free or
        held by a cached entry (evictable)."""
        return self.can_run_more and bool(self.free_seq_ids or self._n_cached_of)

    def fits_stream(self, n_cells: int) -> bool:
        """``n_cells`` fit under one id: always on a unified cache, within one stream on a split one."""
        return self.stream_cells is None or n_cells <= self.stream_cells

    def can_allocate(self, n_cells: int) -> bool:
        """True if another sequence may run, an id is free and ``n_cells`` more cells fit in ``n_ctx``."""
        return self.can_run_more and bool(self.free_seq_ids) and n_cells <= self.n_cells_free \
            and self.fits_stream(n_cells)

    def can_allocate_evicting(self, n_cells: int) -> bool:
        """True if ``n_cells`` would fit under some id once every cached sequence is evicted."""
        if not self.id_available or not self.fits_stream(n_cells):
            return False
        shares = self._shares_without(set(self._n_cached_of))
        return self.n_cells_reserved - sum(n for _, n in shares.values()) + n_cells <= self.n_ctx

    def allocate(self, n_cells: int) -> int:
        """Reserve ``n_cells`` cells under a free sequence id and return that id."""
        assert n_cells >= 0 and self.can_allocate(n_cells)
        seq_id = self.free_seq_ids.pop()
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells
        self.n_running += 1
        return seq_id

    def can_allocate_sharing(self, n_cells: int, n_shared: int) -> bool:
        return self.can_run_more and bool(self.free_seq_ids) and n_cells - n_shared <= self.n_cells_free \
            and self.fits_stream(n_cells)

    def allocate_sharing(self, n_cells: int, src_id: int, n_shared: int) -> int:
        """Reserve ``n_cells`` under a free id whose first ``n_shared`` of them are ``src_id``'s first cells."""
        assert 0 < n_shared <= min(n_cells, self.n_cells_held(src_id)) and self.can_allocate_sharing(n_cells, n_shared)
        seq_id = self.free_seq_ids.pop()
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells
        self.n_running += 1
        self._shares[seq_id] = (src_id, n_shared)
        if self.cells is not None:
            self.cells.share(src_id, seq_id, n_shared)
        return seq_id

    def n_cells_of(self, seq_id: int) -> int:
        """Cells reserved under ``seq_id`` now."""
        n_cells = self._n_cells_of[seq_id]
        assert n_cells is not None, f"sequence id {seq_id} is not allocated"
        return n_cells

    def n_cells_held(self, seq_id: int) -> int:
        """Cells under ``seq_id``, running (reserved) or cached."""
        cached = self._n_cached_of.get(seq_id)
        return cached if cached is not None else self.n_cells_of(seq_id)

    def can_grow(self, seq_id: int, n_cells: int) -> bool:
        """True if ``seq_id``'s reservation can become ``n_cells`` (at least what it holds)."""
        return self.n_cells_in_use - self.n_cells_of(seq_id) + n_cells <= self.n_ctx and self.fits_stream(n_cells)

    def grow(self, seq_id: int, n_cells: int) -> None:
        """Make ``seq_id``'s reservation ``n_cells``; a reservation never shrinks while the id is held."""
        held = self.n_cells_of(seq_id)
        assert n_cells >= held and self.can_grow(seq_id, n_cells)
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells - held

    def free(self, seq_id: int) -> None:
        """Give back ``seq_id`` and the cells it reserved (those it shares stay with their other holders)."""
        n_cells = self.n_cells_of(seq_id)
        self._unlink(seq_id)
        self._keep_cells(seq_id, 0)
        self._n_cells_of[seq_id] = None
        self.n_cells_reserved -= n_cells
        self.n_running -= 1
        self.free_seq_ids.append(seq_id)

    # cached sequences (homepd.core.prefixreuse) -------------------------------------
    def cache(self, seq_id: int, n_cells: int) -> None:
        """``seq_id`` finished and its KV (``n_cells`` cells, at most what it reserved) stays as a cached prefix."""
        held = self.n_cells_of(seq_id)
        assert 0 < n_cells <= held, (n_cells, held)
        self._n_cells_of[seq_id] = None
        self.n_cells_reserved -= held
        self.n_running -= 1
        self._n_cached_of[seq_id] = n_cells
        self.n_cells_cached += n_cells
        self._cap_shares(seq_id, n_cells)
        self._keep_cells(seq_id, n_cells)

    def uncache(self, seq_id: int) -> None:
        """Evict cached ``seq_id``: the id is free, and its cells no other id holds."""
        self._unlink(seq_id)
        self._keep_cells(seq_id, 0)
        self.n_cells_cached -= self._n_cached_of.pop(seq_id)
        self.free_seq_ids.append(seq_id)

    def trim_cached(self, seq_id: int, n_cells: int) -> None:
        """Cached ``seq_id`` keeps only its first ``n_cells`` cells."""
        held = self._n_cached_of[seq_id]
        assert 0 < n_cells <= held
        self._n_cached_of[seq_id] = n_cells
        self.n_cells_cached -= held - n_cells
        self._cap_shares(seq_id, n_cells)
        self._keep_cells(seq_id, n_cells)

    def can_take(self, seq_id: int, n_cells: int) -> bool:
        """True if cached ``seq_id`` can become a request's with ``n_cells`` reserved (its kept cells included)."""
        return self.can_run_more and self.n_cells_in_use - self._n_cached_of[seq_id] + n_cells <= self.n_ctx \
            and self.fits_stream(n_cells)

    def take(self, seq_id: int, n_cells: int) -> None:
        """Cached ``seq_id`` becomes a request's, reserving ``n_cells`` (the prefix it keeps among them)."""
        assert n_cells >= self._n_cached_of[seq_id] and self.can_take(seq_id, n_cells)
        self.n_cells_cached -= self._n_cached_of.pop(seq_id)
        self._n_cells_of[seq_id] = n_cells
        self.n_cells_reserved += n_cells
        self.n_running += 1

    def _keep_cells(self, seq_id: int, n_cells: int) -> None:
        if self.cells is not None:
            self.cells.keep(seq_id, n_cells)

    # the sharing forest --------------------------------------------------------------
    def _unlink(self, seq_id: int) -> None:
        """``seq_id`` goes away: the ids sharing its first cells now share them with its own source (as far
        as it shared them), or with nobody."""
        self._shares = self._shares_without({seq_id})

    def _cap_shares(self, seq_id: int, n_cells: int) -> None:
        """``seq_id`` now holds only its first ``n_cells``: what it shares is capped; an id sharing more of
        its cells than that shares the rest with ``seq_id``'s source, if that holds them, else alone."""
        parent = self._shares.get(seq_id)
        if parent is not None and parent[1] > n_cells:
            self._shares[seq_id] = (parent[0], n_cells)
        for child, (src, n) in list(self._shares.items()):
            if src == seq_id and n > n_cells:
                # why: the cells past n_cells stay physically; the child now shares them with seq_id's
                # source if seq_id had them from it, else the child alone holds them
                self._shares[child] = (parent[0], min(n, parent[1])) if parent is not None and parent[1] > n_cells \
                    else (seq_id, n_cells)

    def _shares_without(self, gone: set[int]) -> dict[int, tuple[int, int]]:
        """The sharing forest once the ids in ``gone`` are unlinked (the allocator is unchanged)."""
        shares = dict(self._shares)
        for seq_id in gone:
            parent = shares.pop(seq_id, None)
            for child, (src, n) in list(shares.items()):
                if src == seq_id:
                    if parent is None:
                        del shares[child]
                    else:
                        shares[child] = (parent[0], min(n, parent[1]))
        return {k: v for k, v in shares.items() if k not in gone}
