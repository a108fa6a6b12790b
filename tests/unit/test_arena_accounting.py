"""Memory accounting by what holds it (homepd.hw.smaps): this process's own mappings, a file mapped like
model weights, a KV arena, and private regions like a KV cache; shared pages counted once."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from homepd.core.records import MemoryBreakdown
from homepd.hw.smaps import (ProcessRegions, anon_intervals, measure_processes, new_intervals, read_smaps,
                             resident_bytes)
from homepd.kv.pool import DATA_OFFSET, KVArena
from homepd.measure.memory import breakdown_mib, render_breakdown

MIB = 1 << 20


def _in_fresh_interpreter(check: str, *args: str) -> None:
    """Run ``check`` in a new interpreter.

    # why: these checks find a new mapping by diffing /proc/self/maps; in a process that already freed big
    # arrays (the rest of the suite), the allocator and the kernel may place and merge mappings so that
    # nothing new shows — a worker measures its context the same way, but right after it started.
    """
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_arena_accounting as t; "
            f"t.{check}(*{[Path(a) for a in args]!r})")
    out = subprocess.run([sys.executable, "-c", code.replace("PosixPath", "__import__('pathlib').Path")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_resident_bytes_count_the_pages_written_so_far():
    _in_fresh_interpreter("_check_resident_bytes_count_the_pages_written_so_far")


def test_breakdown_counts_a_shared_file_and_the_arena_once_and_private_regions_per_process(tmp_path):
    _in_fresh_interpreter("_check_breakdown_counts_a_shared_file_and_the_arena_once_and_private_regions_per_process",
                          str(tmp_path))


def test_new_intervals_are_what_was_mapped_in_between_and_large_enough():
    before = [(0, 10 * MIB), (20 * MIB, 30 * MIB)]
    after = [(0, 15 * MIB), (20 * MIB, 40 * MIB), (50 * MIB, 51 * MIB)]
    assert new_intervals(before, after) == [(10 * MIB, 15 * MIB), (30 * MIB, 40 * MIB)]  # 1 MiB: too small
    assert new_intervals(before, after, min_bytes=1) == [(10 * MIB, 15 * MIB), (30 * MIB, 40 * MIB),
                                                         (50 * MIB, 51 * MIB)]


def _check_resident_bytes_count_the_pages_written_so_far():
    before = anon_intervals()
    # why mmap, not np.empty: after other tests freed big arrays, glibc may serve 32 MiB from its heap (its
    # mmap threshold adapts) and no new mapping appears; llama.cpp's buffers are their own mappings
    # a private anonymous mapping, untouched (like a compute buffer); mmap's default would be MAP_SHARED
    raw = mmap.mmap(-1, 32 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = np.frombuffer(raw, dtype=np.uint8)
    regions = new_intervals(before, anon_intervals())
    assert sum(b - a for a, b in regions) >= 32 * MIB
    untouched = resident_bytes("self", regions)
    block[:8 * MIB] = 1
    # a neighbouring mapping the kernel merged in (an interpreter arena) may be touched meanwhile: a little more
    assert 8 * MIB <= resident_bytes("self", regions) - untouched <= 10 * MIB
    del block
    raw.close()


def _check_breakdown_counts_a_shared_file_and_the_arena_once_and_private_regions_per_process(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(os.urandom(6 * MIB))
    with open(weights, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    bytes(mapped[:])  # touch every page, as a worker's first steps do
    before = anon_intervals()
    # its own private mapping (see above), written at once: a cleared KV cache
    kv_map = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    kv = np.frombuffer(kv_map, dtype=np.uint8)
    kv[:] = 1
    regions = tuple(("context", a, b) for a, b in new_intervals(before, anon_intervals()))
    with KVArena.create(4 * MIB) as arena:
        kv_cache_bytes = resident_bytes("self", [r[1:] for r in regions])
        me = ProcessRegions("worker", os.getpid(), regions, kv_cache_bytes=kv_cache_bytes)
        # the same process twice stands for two processes mapping the same file and arena
        b = measure_processes([me, ProcessRegions("controller", os.getpid())], str(weights))
    assert isinstance(b, MemoryBreakdown) and [p.role for p in b.processes] == ["worker", "controller"]
    assert b.weights_shared_bytes == 6 * MIB                          # once, not per process
    assert b.arena_bytes == DATA_OFFSET + 4 * MIB                     # pre-faulted, once
    assert 16 * MIB <= b.kv_cache_bytes < 18 * MIB and b.compute_bytes < 2 * MIB
    assert b.processes[1].kv_cache_bytes == 0                         # told no regions: all its own is rest
    assert b.total_bytes == sum(getattr(b, f) for f in ("weights_shared_bytes", "weights_copied_bytes",
                                                         "kv_cache_bytes", "compute_bytes", "arena_bytes",
                                                         "rest_bytes"))
    own = sum(m.pss_bytes for m in read_smaps(os.getpid()))
    assert abs(b.processes[0].pss_bytes - own) < 8 * MIB
    mib = breakdown_mib(b)
    assert mib["mem_weights_shared_mib"] == 6.0 and mib["mem_total_mib"] == b.total_bytes / MIB
    lines = render_breakdown(b)
    assert lines[0].startswith("memory by what holds it (MiB, each byte once): weights (shared) 6,")
    assert lines[1].startswith(f"  worker (pid {os.getpid()}): PSS ")
    assert breakdown_mib(None)["mem_kv_cache_mib"] is None
    mapped.close()
    del kv
    kv_map.close()


def test_an_unreadable_process_gives_zeros_not_an_error():
    b = measure_processes([ProcessRegions("gone", 2 ** 22 + 12345, (("context", 0, 4096),), 4096)], None)
    assert b.total_bytes == 0 and b.processes[0].pss_bytes == 0


def test_the_engines_arena_is_counted_by_its_names_not_every_arena_the_process_maps():
    # a test process (the controller) may still map another engine's arena; only the named one is this engine's
    with KVArena.create(64 * 1024) as other, KVArena.create(1 << 20) as own:
        me = [ProcessRegions("controller", os.getpid())]
        assert measure_processes(me, None, own.names).arena_bytes == DATA_OFFSET + (1 << 20)
        assert measure_processes(me, None, ()).arena_bytes == 0
        assert measure_processes(me, None).arena_bytes >= 2 * DATA_OFFSET + (1 << 20) + 64 * 1024
        assert other.names != own.names
