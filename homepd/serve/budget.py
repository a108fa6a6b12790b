"""The memory budget the models of a service share (``--memory-budget``): what the plan of each load counts
against (``homepd.models.planner``).

Default: the RAM the probe finds available when the service starts, less a reserve for the OS and everything
else on the box (``os_reserve_bytes``: a tenth of the RAM, at least 512 MiB).  What a model takes on a GPU is
not planned apart: the budget is host memory (a model offloaded to a GPU still maps its weights here).
"""
from __future__ import annotations

MIN_RESERVE_BYTES = 512 << 20
UNBOUNDED_BYTES = 1 << 62   # one model without --memory-budget: loaded whatever its size, as before
RESERVE_SHARE = 0.10


def os_reserve_bytes(ram_total_bytes: int) -> int:
    return max(MIN_RESERVE_BYTES, int(ram_total_bytes * RESERVE_SHARE))


def memory_budget_bytes(settings) -> int:
    """``settings.memory_budget_bytes``, else the available RAM less the OS reserve (at least 1 byte less
    nothing: a box already short of memory gets a budget of 0, and every load is refused with the figures)."""
    if settings.memory_budget_bytes is not None:
        return settings.memory_budget_bytes
    from homepd.hw.probe import probe_memory  # why: psutil loads when the budget is measured, not at import

    memory = probe_memory()
    total, available = memory.ram_total_bytes or 0, memory.ram_available_bytes or 0
    return max(0, available - os_reserve_bytes(total))
