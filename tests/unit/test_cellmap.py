"""The mirror of llama.cpp's cell placement (homepd.cellmap) against a cell-by-cell transcription of
``llama_kv_cache::find_slot`` / ``apply_ubatch`` / ``seq_rm`` / ``seq_cp`` (the vendored llama.cpp's code, one
cell at a time, as it is written there), on random event sequences; and what a step then attends over."""
from __future__ import annotations

import random

from homepd.cellmap import N_PAD, CellMap
from homepd.core.allocator import KVAllocator
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.core.sampling import SamplingParams


class LlamaCells:
    """llama.cpp's unified cache, transcribed cell by cell: each cell's set of (seq, pos), the head."""

    def __init__(self, size: int):
        self.size, self.head = size, 0
        self.cells: list[dict[int, int]] = [dict() for _ in range(size)]  # seq -> pos
        self.next_pos: dict[int, int] = {}

    def used(self) -> int:
        return sum(1 for c in self.cells if c)

    def find_slot(self, n_tokens: int, cont: bool = False) -> list[int] | None:
        head_cur = self.head
        if head_cur > self.used() + 2 * n_tokens:
            head_cur = 0
        n_test = n_tokens if cont else 1
        idxs: list[int] = []
        n_tested = 0
        while True:
            if head_cur + n_test > self.size:
                n_tested += self.size - head_cur
                head_cur = 0
                continue
            for _ in range(n_test):
                idx = head_cur
                head_cur += 1
                n_tested += 1
                if not self.cells[idx]:
                    idxs.append(idx)
                elif cont:
                    break
            if len(idxs) == n_tokens:
                return idxs
            if cont:
                idxs = []
            if n_tested >= self.size:
                return None

    def decode(self, tokens: list[tuple[int, int]]) -> bool:
        n = sum(k for _, k in tokens)
        idxs = self.find_slot(n)
        if idxs is None:
            return False
        it = iter(idxs)
        for seq, k in tokens:
            for _ in range(k):
                pos = self.next_pos.get(seq, 0)
                self.cells[next(it)][seq] = pos
                self.next_pos[seq] = pos + 1
        self.head = idxs[-1] + 1
        return True

    def seq_rm(self, seq: int, p0: int) -> None:
        new_head = self.size
        for i, c in enumerate(self.cells):
            if seq in c and c[seq] >= p0:
                del c[seq]
                if not c and new_head == self.size:
                    new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        self.next_pos[seq] = min(self.next_pos.get(seq, 0), p0)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        for c in self.cells:
            if src in c and c[src] < n:
                c[dst] = c[src]
        self.next_pos[dst] = n

    def cells_of(self, seq: int) -> list[int]:
        return [i for _, i in sorted((c[seq], i) for i, c in enumerate(self.cells) if seq in c)]

    def used_max_p1(self) -> int:
        return max((i + 1 for i, c in enumerate(self.cells) if c), default=0)


def cells_of(m: CellMap, seq: int) -> list[int]:
    return [i for start, stop in m._runs.get(seq, ()) for i in range(start, stop)]


def test_the_mirror_puts_every_token_where_llama_cpp_does_over_random_events():
    for trial in range(40):
        rng = random.Random(trial)
        size = rng.choice([64, 200, 512])
        ref, m = LlamaCells(size), CellMap(size)
        live: list[int] = []
        for _ in range(120):
            op = rng.random()
            if op < 0.45:  # a batch: some decodes and maybe a prompt slice
                seqs = rng.sample(range(8), rng.randint(1, 3))
                tokens = [(s, rng.choice([1, 1, 2, 7, 30])) for s in seqs]
                fits = sum(k for _, k in tokens) <= size - ref.used()
                if not fits:
                    continue
                if ref.decode(tokens):
                    m.place(tokens)
                    live.extend(s for s, _ in tokens if s not in live)
            elif op < 0.75 and live:  # a sequence goes, or keeps its first positions
                seq = rng.choice(live)
                keep = rng.choice([0, 0, rng.randint(0, max(0, ref.next_pos.get(seq, 0)))])
                ref.seq_rm(seq, keep)
                m.keep(seq, keep)
                if keep == 0:
                    live.remove(seq)
            elif live:  # a copy of a sequence's first positions under a free id
                src = rng.choice(live)
                free = [s for s in range(8) if s not in live]
                if not free:
                    continue
                dst, n = free[0], rng.randint(1, max(1, ref.next_pos.get(src, 1)))
                ref.seq_rm(dst, 0)
                ref.seq_cp(src, dst, n)
                m.share(src, dst, n)
                live.append(dst)
            for seq in range(8):
                assert cells_of(m, seq) == ref.cells_of(seq), (trial, seq)
                assert m.n_of(seq) == len(ref.cells_of(seq))
            assert (m.head, m.used_max, m.n_used) == (ref.head, ref.used_max_p1(), ref.used())


def test_a_step_attends_over_the_used_range_padded_not_the_cells_in_use():
    m = CellMap(4096)
    m.place([(0, 2000), (1, 400), (2, 400)])
    m.keep(0)  # a 2,000-cell hole below two sequences of 400
    assert m.n_used == 800
    assert m.attended() == 2816  # used_max 2,800 padded to 256
    assert m.attended(1) == 2816  # its next token goes into the hole (head back to 0)
    compact = CellMap(4096)
    compact.place([(1, 400), (2, 400)])
    assert compact.attended() == 1024
    assert CellMap(4096).attended() == N_PAD  # llama.cpp pads an empty range to 256 too


def test_the_scheduler_prices_a_step_by_the_range_its_tokens_leave():
    """The scheduler's plan reads the mirror: a decode above a freed document's hole is priced at the range."""
    sched = Scheduler(n_seq_max=2, n_ctx=4096, n_batch=512, chunk=512)
    doc = Sequence("doc", list(range(1500)), SamplingParams(max_tokens=4))
    chat = Sequence("chat", list(range(100)), SamplingParams(max_tokens=50))
    sched.add(doc)
    sched.add(chat)
    seen = []
    while not chat.is_finished and len(seen) < 60:
        plan = sched.schedule()
        seen.append(plan.kv_in_use)
        got = sched.postprocess(plan, {s.request_id: 1 for s in [*plan.decode, *(sl.seq for sl in plan.prefill)]})
        for seq in got:
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.release(seq)
    assert doc.is_finished and chat.is_finished
    # the document's 1,500 cells were below the chat's: its range stays after they are freed
    assert sched.allocator.cells.n_used == 0
    assert min(seen[-5:]) >= 1536, seen


def test_a_unified_allocator_keeps_the_mirror_in_step_with_its_ids():
    alloc = KVAllocator(n_seq_max=2, n_ctx=1024, n_cached_ids=1)
    a = alloc.allocate(100)
    alloc.cells.place([(a, 100)])
    alloc.cache(a, 60)  # a finished sequence keeps 60 of its cells as a cached prefix
    assert alloc.cells.n_of(a) == 60 and alloc.cells.n_used == 60
    b = alloc.allocate_sharing(80, a, 40)
    assert alloc.cells.n_of(b) == 40 and alloc.cells.n_used == 60  # shared, not copied
    alloc.uncache(a)
    assert alloc.cells.n_used == 40  # b still holds the first 40
    alloc.free(b)
    assert alloc.cells.n_used == 0 and alloc.cells.used_max == 0
    assert KVAllocator(n_seq_max=2, n_ctx=1024, stream_cells=512).cells is None  # split: no one pool to mirror
