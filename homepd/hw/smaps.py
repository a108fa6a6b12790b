"""Where homepd's memory goes, by what holds it: read from ``/proc/<pid>/smaps`` and ``/proc/<pid>/pagemap``.

Worker side, at load: ``anon_intervals()`` before and after loading the model
and after creating the context; ``new_intervals`` between two readings is what
llama.cpp mapped in that phase — "model" regions (repacked weights, vocabulary
tables) and "context" regions (KV cache, compute and output buffers).  The
kernel merges adjacent mappings, so the KV cache and the compute buffers are
not told apart by address: llama.cpp clears the KV cache when it makes the
context and writes a compute buffer only when a step uses it, so the context
regions' resident bytes right after creation are the KV cache
(``kv_cache_bytes``); what becomes resident there later is compute buffers.

Controller side: ``measure_processes`` reads every homepd process and returns
a ``MemoryBreakdown`` in which the model file's pages and the KV arena, mapped
by several processes, are counted once (their largest resident size, so a
process outside homepd mapping the same GGUF does not hide part of them).
Linux only; elsewhere every figure is 0.
"""
from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from homepd.core.records import MemoryBreakdown, ProcessMemoryBreakdown

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIN_REGION_BYTES = 2 << 20   # smaller new mappings are interpreter arenas and the like: "rest"
SHM_DIR = "/dev/shm/"
ARENA_PREFIX = SHM_DIR + "homepd-kv-"
STORE_PREFIX = SHM_DIR + "homepd-kvstore-"  # the KV store tier (homepd.kv.store)

Interval = tuple[int, int]   # [start, end) addresses


# worker side ---------------------------------------------------------------------
def anon_intervals(pid: int | str = "self") -> list[Interval]:
    """Writable anonymous mappings of ``pid`` (merged, sorted), from ``/proc/<pid>/maps``."""
    out: list[Interval] = []
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or "w" not in fields[1] or (len(fields) == 6 and fields[5].strip()):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    except OSError:
        return []
    return _merge(out)


def new_intervals(before: list[Interval], after: list[Interval], min_bytes: int = MIN_REGION_BYTES) -> list[Interval]:
    """Address ranges mapped in ``after`` but not in ``before``, each at least ``min_bytes`` long."""
    out = []
    for start, end in after:
        pieces = [(start, end)]
        for b_start, b_end in before:
            pieces = [p for a, z in pieces for p in ((a, min(z, b_start)), (max(a, b_end), z)) if p[0] < p[1]]
        out += [p for p in pieces if p[1] - p[0] >= min_bytes]
    return out


def _merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def resident_bytes(pid: int | str, intervals) -> int:
    """Bytes of ``intervals`` (addresses in ``pid``) backed by RAM now (``/proc/<pid>/pagemap`` present bit)."""
    total = 0
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as fh:
            for start, end in intervals:
                fh.seek(start // PAGE_BYTES * 8)
                entries = np.frombuffer(fh.read((end - start) // PAGE_BYTES * 8), dtype=np.uint64)
                total += int(np.count_nonzero(entries >> np.uint64(63))) * PAGE_BYTES
    except (OSError, ValueError):
        return 0
    return total


# controller side -------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    path: str
    rss_bytes: int
    pss_bytes: int


def read_smaps(pid: int) -> list[Mapping]:
    """Every mapping of ``pid`` with its path ("" when anonymous), RSS and PSS; [] when unreadable."""
    mappings: list[Mapping] = []
    path, rss, pss = None, 0, 0
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a new mapping's header line
                    if path is not None:
                        mappings.append(Mapping(path, rss, pss))
                    fields = line.split(maxsplit=5)
                    path, rss, pss = (fields[5].strip() if len(fields) == 6 else ""), 0, 0
                elif head == "Rss:":
                    rss = int(line.split()[1]) * 1024
                elif head == "Pss:":
                    pss = int(line.split()[1]) * 1024
    except OSError:
        return []
    if path is not None:
        mappings.append(Mapping(path, rss, pss))
    return mappings


@dataclass(frozen=True)
class ProcessRegions:
    """What one process told about its memory: its large private regions by phase, and its KV cache size."""
    role: str
    pid: int
    regions: tuple[tuple[str, int, int], ...] = ()   # ("model" | "context", start, end)
    kv_cache_bytes: int = 0


def measure_process(proc: ProcessRegions, model_path: str | None, arena_names: Collection[str] | None = None
                    ) -> tuple[ProcessMemoryBreakdown, int, int, dict[str, int]]:
    """One process's breakdown, and its resident bytes of the model file, of the KV arena and of the KV store
    by segment (for counting once).  ``arena_names``: the arena's segments (``KVArena.names``); None: any
    homepd arena mapped."""
    mappings = read_smaps(proc.pid)
    real_model = os.path.realpath(model_path) if model_path else None
    name = os.path.basename(real_model) if real_model else None
    model = [m for m in mappings if real_model and os.path.basename(m.path) == name
             and os.path.realpath(m.path) == real_model]
    arena = [m for m in mappings if _is_arena(m.path, arena_names)]
    store = [m for m in mappings if m.path.startswith(STORE_PREFIX)]
    copied = resident_bytes(proc.pid, [(a, b) for kind, a, b in proc.regions if kind == "model"])
    context = resident_bytes(proc.pid, [(a, b) for kind, a, b in proc.regions if kind == "context"])
    kv = min(proc.kv_cache_bytes, context)
    pss = sum(m.pss_bytes for m in mappings)
    mapped = sum(m.pss_bytes for m in model) + sum(m.pss_bytes for m in arena) + sum(m.pss_bytes for m in store)
    rest = max(0, pss - mapped - copied - context)
    breakdown = ProcessMemoryBreakdown(
        role=proc.role, pid=proc.pid, pss_bytes=pss, weights_mapped_bytes=sum(m.pss_bytes for m in model),
        weights_copied_bytes=copied, kv_cache_bytes=kv, compute_bytes=context - kv,
        arena_bytes=sum(m.pss_bytes for m in arena), rest_bytes=rest, kv_store_bytes=sum(m.pss_bytes for m in store))
    return (breakdown, sum(m.rss_bytes for m in model), sum(m.rss_bytes for m in arena),
            {m.path: m.rss_bytes for m in store})


def _is_arena(path: str, names: Collection[str] | None) -> bool:
    """Whether a mapping of ``path`` is one of the arena's segments ``names`` (None: any homepd arena's).
    # why named: the controller's process may map arenas that are not its engine's (a test process that ran
    # others, a library user's own pool); counted by prefix, one leaked 64 KiB arena put 68 KiB on the engine's"""
    if names is None:
        return path.startswith(ARENA_PREFIX)
    return any(path == SHM_DIR + name for name in names)


def measure_processes(processes: list[ProcessRegions], model_path: str | None,
                      arena_names: Collection[str] | None = None) -> MemoryBreakdown:
    """The breakdown over ``processes`` (the controller and its workers): shared mappings counted once.
    ``arena_names``: the engine's KV arena segments (``()``: it has none); None: any homepd arena mapped."""
    parts, model_rss, arena_rss, store_rss = [], [0], [0], {}
    for proc in processes:
        breakdown, model, arena, store = measure_process(proc, model_path, arena_names)
        parts.append(breakdown)
        model_rss.append(model)
        arena_rss.append(arena)
        for path, rss in store.items():
            store_rss[path] = max(rss, store_rss.get(path, 0))
    return MemoryBreakdown(
        weights_shared_bytes=max(model_rss), weights_copied_bytes=sum(p.weights_copied_bytes for p in parts),
        kv_cache_bytes=sum(p.kv_cache_bytes for p in parts), compute_bytes=sum(p.compute_bytes for p in parts),
        arena_bytes=max(arena_rss), rest_bytes=sum(p.rest_bytes for p in parts), processes=tuple(parts),
        kv_store_bytes=sum(_shm_resident_bytes(path, rss) for path, rss in store_rss.items()))


def _shm_resident_bytes(path: str, rss_bytes: int) -> int:
    """The pages a /dev/shm file holds (tmpfs blocks).  # why not the processes' RSS: a dead worker's saved
    pages are in no live process's page tables until its replacement reads them, yet they take RAM."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return rss_bytes
