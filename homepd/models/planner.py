"""Which models fit in memory at once, and which to evict for a load: pure policy over constructed states.

A service with several models (issue 45) asks ``plan_load`` before each load: given what is resident (each
model's footprint, whether it is pinned, busy or loading, how long it took to load, when and how often it was
used) and a memory budget, may the new model load now, after which evictions, or must it wait for a busy
model to go idle?  A model that cannot fit even alone is told apart from one that waits, with the bytes.  No
clock, no I/O: the caller passes ``now_s`` and applies the plan (``homepd.serve.registry``).

The victim is the idle model whose eviction costs least per byte freed: its expected reload cost is its
measured load time, times how likely it is to come back (its uses, discounted by how long it has been idle),
so a large model used once an hour ago goes before a small one used every minute.

``estimate_bytes`` is the footprint of a model never measured, from its GGUF header, with a stated margin;
a measured footprint (``homepd.store.footprints``) replaces it after the first load.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

# why 1.25 and 48 MiB: measured on the 2-vCPU VM (docs/serve.md, "Several models"), a worker's PSS beyond the
# weights and the KV cache (compute buffers, the interpreter, llama.cpp's own) was 30-45 MiB for SmolLM2-135M
# and Gemma 3 270M; the margin covers the rest (repacked weights, output buffers) without refusing a fit
ESTIMATE_MARGIN = 1.25
WORKER_OVERHEAD_BYTES = 48 << 20
RECENCY_S = 600.0          # a model idle this long counts half as likely to come back as one used just now
DEFAULT_RELOAD_S = 1.0     # a model never loaded here: what its reload is assumed to cost


class PlanKind(enum.StrEnum):
    FITS = "fits"              # load now, nothing to evict
    EVICT = "evict"            # evict ``victims`` first, then load
    WAIT = "wait"              # it would fit once busy (or loading) models are idle: wait, then plan again
    TOO_LARGE = "too_large"    # it cannot fit even alone under the budget: refuse, with the bytes


@dataclass(frozen=True)
class Resident:
    """One model that holds memory now (loaded or loading), as the planner sees it."""
    name: str
    footprint_bytes: int
    is_pinned: bool = False
    n_in_flight: int = 0        # requests admitted to it and not finished (also those waiting on its load)
    is_loading: bool = False
    reload_s: float | None = None   # its measured load time; None: never measured
    last_used_s: float = 0.0        # the caller's monotonic clock
    n_uses: int = 0

    @property
    def is_evictable(self) -> bool:
        return not (self.is_pinned or self.n_in_flight or self.is_loading)


@dataclass(frozen=True)
class LoadPlan:
    kind: PlanKind
    needed_bytes: int            # the new model's footprint
    free_bytes: int              # budget less what is resident now
    budget_bytes: int
    victims: tuple[str, ...] = ()
    freed_bytes: int = 0

    def describe(self, name: str) -> str:
        """The log line of this plan ("evicted a to fit b: 420 MB needed, 310 MB free")."""
        need, free = f"{_mb(self.needed_bytes)} needed", f"{_mb(self.free_bytes)} free"
        if self.kind is PlanKind.EVICT:
            return f"evicting {', '.join(self.victims)} to fit {name}: {need}, {free} ({_mb(self.freed_bytes)} freed)"
        if self.kind is PlanKind.WAIT:
            return f"{name} waits for a busy model to go idle: {need}, {free}"
        if self.kind is PlanKind.TOO_LARGE:
            return f"{name} cannot fit: {need}, the budget is {_mb(self.budget_bytes)}"
        return f"{name} fits: {need}, {free}"


def eviction_cost(r: Resident, now_s: float, bytes_needed: int) -> float:
    """Expected reload seconds per byte freed: ``reload_s`` times the model's chance of coming back (uses,
    discounted by idle time), over the bytes it frees (at most what is needed counts: a huge victim is no
    cheaper than the bytes it has to give)."""
    reload_s = r.reload_s if r.reload_s is not None else DEFAULT_RELOAD_S
    idle_s = max(0.0, now_s - r.last_used_s)
    likelihood = (1 + r.n_uses) / (1 + idle_s / RECENCY_S)
    return reload_s * likelihood / max(1, min(r.footprint_bytes, bytes_needed))


def plan_load(name: str, needed_bytes: int, residents: list[Resident], budget_bytes: int, now_s: float) -> LoadPlan:
    """What loading ``name`` (``needed_bytes``) under ``budget_bytes`` takes, given ``residents`` (``name``
    itself must not be among them)."""
    assert all(r.name != name for r in residents), f"{name} is already resident"
    used = sum(r.footprint_bytes for r in residents)
    free = budget_bytes - used
    plan = lambda kind, victims=(), freed=0: LoadPlan(kind, needed_bytes, free, budget_bytes,  # noqa: E731
                                                      tuple(victims), freed)
    if needed_bytes > budget_bytes:
        return plan(PlanKind.TOO_LARGE)
    if needed_bytes <= free:
        return plan(PlanKind.FITS)
    short = needed_bytes - free
    idle = sorted((r for r in residents if r.is_evictable),
                  key=lambda r: (eviction_cost(r, now_s, short), r.name))
    victims, freed = [], 0
    for r in idle:
        if freed >= short:
            break
        victims.append(r)
        freed += r.footprint_bytes
    if freed < short:
        pinned = sum(r.footprint_bytes for r in residents if r.is_pinned)
        # why: what is pinned stays for good; if the rest of the budget cannot hold the model, waiting never helps
        return plan(PlanKind.TOO_LARGE if needed_bytes > budget_bytes - pinned else PlanKind.WAIT)
    # why: a greedy pick may take a victim that a later, larger one made unnecessary; give those back
    for r in sorted(victims, key=lambda r: -eviction_cost(r, now_s, short)):
        if freed - r.footprint_bytes >= short:
            victims.remove(r)
            freed -= r.footprint_bytes
    return plan(PlanKind.EVICT, [r.name for r in victims], freed)


def estimate_bytes(model_bytes: int, kv_bytes_per_token: int, n_ctx_cells: int, n_workers: int = 1,
                   shared_bytes: int = 0) -> int:
    """The footprint of a model never measured: each worker maps the weights (shared pages, counted once) and
    holds its KV cache (``n_ctx_cells`` over all workers) and its overhead, times ``ESTIMATE_MARGIN``; plus
    ``shared_bytes`` (a KV arena or store the load allocates, known exactly)."""
    body = model_bytes + kv_bytes_per_token * n_ctx_cells + WORKER_OVERHEAD_BYTES * n_workers
    return int(body * ESTIMATE_MARGIN) + shared_bytes


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.0f} MB"
