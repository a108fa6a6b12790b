"""The memory breakdown as figures a reader compares: MiB by what holds the memory, for run reports and
advise's evidence (measured by ``homepd.hw.smaps`` through ``Engine.measure_memory``)."""
from __future__ import annotations

from homepd.core.records import MemoryBreakdown

MIB = 2 ** 20
# (field of MemoryBreakdown, short key for tables, words for reports)
CATEGORIES = (("weights_shared_bytes", "weights_shared", "weights (shared)"),
              ("weights_copied_bytes", "weights_copied", "weights (copied)"),
              ("kv_cache_bytes", "kv_cache", "KV caches"),
              ("compute_bytes", "compute", "compute buffers"),
              ("arena_bytes", "arena", "KV arena"),
              ("kv_store_bytes", "kv_store", "KV store"),
              ("rest_bytes", "rest", "rest"))


def breakdown_mib(breakdown: MemoryBreakdown | None) -> dict[str, float | None]:
    """``{"mem_weights_shared_mib": ..., ..., "mem_total_mib": ...}``; every value None without a breakdown."""
    keys = [f"mem_{key}_mib" for _, key, _ in CATEGORIES] + ["mem_total_mib"]
    if breakdown is None:
        return dict.fromkeys(keys)
    values = [getattr(breakdown, name) / MIB for name, _, _ in CATEGORIES] + [breakdown.total_bytes / MIB]
    return dict(zip(keys, values))


def render_breakdown(breakdown: MemoryBreakdown) -> list[str]:
    """Report lines: the total by what holds it (each byte once), then each process's PSS the same way."""
    parts = ", ".join(f"{words} {getattr(breakdown, name) / MIB:.0f}" for name, _, words in CATEGORIES)
    lines = [f"memory by what holds it (MiB, each byte once): {parts}; total {breakdown.total_bytes / MIB:.0f}"]
    for p in breakdown.processes:
        shares = [(words, getattr(p, "weights_mapped_bytes" if name == "weights_shared_bytes" else name))
                  for name, _, words in CATEGORIES]
        held = ", ".join(f"{words} {value / MIB:.0f}" for words, value in shares if value)
        lines.append(f"  {p.role} (pid {p.pid}): PSS {p.pss_bytes / MIB:.0f}" + (f" = {held}" if held else ""))
    return lines
