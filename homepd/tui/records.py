"""What the app shows, as frozen records: every data source produces these, every widget reads them.

Units are in the names (``_ms``, ``_bytes``, ``_pct``); ``None`` is "not
known here" and is shown as ``NA``.  Built from engine and sampler records
(``EngineSnapshot``, ``RequestTimings``: the embedded engine's own, or decoded
from ``homepd serve``'s JSON at the HTTP edge) by ``homepd.tui.derive``; from advise
results and stored runs by ``homepd.tui.evidence``.
"""
from __future__ import annotations

from dataclasses import dataclass

from homepd.advise.report.pictures import Pictures
from homepd.core.terms import RequestClass, ReuseMode
from homepd.core.records import WorkerSnapshot

SHORT_ID_CHARS = 12  # a request id as the app shows it: its tail (an OpenAI-style id's 29 characters fill a column)


def short_id(request_id: str) -> str:
    """``request_id`` as the app shows it, in its request table and in the stall it names."""
    return request_id[-SHORT_ID_CHARS:]


@dataclass(frozen=True)
class GpuView:
    index: int
    name: str
    utilization_pct: int | None
    vram_used_bytes: int | None
    vram_total_bytes: int | None
    power_w: float | None
    temperature_c: int | None
    pcie_tx_bytes_s: int | None
    pcie_rx_bytes_s: int | None
    pcie_link: str = ""            # "Gen4 x16" (of max "Gen4 x16"), from the probe


@dataclass(frozen=True)
class ProcessView:
    role: str
    pid: int
    cpu_pct: float | None
    rss_bytes: int | None
    uss_bytes: int | None


@dataclass(frozen=True)
class HardwareView:
    cpu_model: str | None
    n_cpus: int | None
    cpu_pct: float | None
    cpu_pct_per_core: tuple[float, ...] | None     # None: the sampler does not record it
    ram_used_bytes: int | None
    ram_total_bytes: int | None
    gpus: tuple[GpuView, ...]
    processes: tuple[ProcessView, ...]
    gpu_note: str = ""                             # why there is no GPU, when there is none


@dataclass(frozen=True)
class ArenaView:
    """Disaggregated: the KV arena between the workers, holding one extent per request in transit."""
    capacity_bytes: int
    used_bytes: int                # what those extents hold now
    extents: dict[str, int]        # extent state (WRITING / READY / READING) -> extents
    max_extents: int | None        # live at once (the handoff back-pressure bound); None: no cap

    @property
    def n_extents(self) -> int:
        return sum(self.extents.values())


@dataclass(frozen=True)
class CacheView:
    """One worker's prefix cache (``PrefixCacheStats``): how much of the prompts it served, what it holds."""
    worker: str
    hit_ratio: float | None        # reused / looked-up prompt tokens since the worker started (None: none yet)
    n_hit_tokens: int
    n_lookup_tokens: int
    cached_bytes: int              # KV the cached prefixes hold in the worker's context
    store_bytes: int = 0           # ... and in the host-memory KV store
    n_store_entries: int = 0
    mode: ReuseMode = ReuseMode.PREFIX  # what llama.cpp allows for this cache type


@dataclass(frozen=True)
class ArchitectureView:
    mode: str                      # colocated | disaggregated | replicas
    model: str
    chunk: int | None
    n_ctx: int
    workers: tuple[WorkerSnapshot, ...]  # as the engine reports them (homepd.core.records)
    by_state: dict[str, int]       # lifecycle state -> requests
    kv_arena: ArenaView | None = None
    kv_mb_s: float | None = None   # KV handed off per second over the last tick
    events: tuple[str, ...] = ()   # recent worker deaths and restarts, newest last
    note: str = ""                 # e.g. "remote: http://127.0.0.1:8439 (ready)"
    classes: tuple[str, ...] = ()  # two queues: one line per request class (queued, decisions, budgets)
    budgets: str = ""              # chosen prompt budget per worker, TTFT prediction error, routing
    kv_stream_cells: int | None = None  # the KV cache split in one stream per sequence (--kv-layout streams)
    caches: tuple[CacheView, ...] = ()  # the workers that have a prefix cache

    @property
    def n_waiting(self) -> int:
        return self.by_state.get("waiting", 0)

    @property
    def n_running(self) -> int:
        return sum(n for state, n in self.by_state.items() if state != "waiting")


@dataclass(frozen=True)
class RequestRow:
    """A finished request, with the stall that hurt it most (if any gap passed the ITL target)."""
    request_id: str
    state: str
    n_prompt_tokens: int
    n_output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    itl_max_ms: float | None
    kv_bytes: int | None = None
    stall: str = ""                # "412 ms held by req-7 (256 prompt tok, same step)"
    request_class: RequestClass = RequestClass.INTERACTIVE


@dataclass(frozen=True)
class ChartPoint:
    """One tick of the live charts (None: nothing happened in that tick)."""
    t_s: float
    ttft_ms: float | None = None
    itl_ms: float | None = None         # the longest inter-token gap (or decode step) in the tick
    tpot_ms: float | None = None
    tok_s: float | None = None
    interference: float | None = None   # slowdown of disturbed decode steps (1.0 = none)


@dataclass(frozen=True)
class Tick:
    """Everything the dashboard needs, taken at once by ``DataSource.tick``."""
    hardware: HardwareView | None
    architecture: ArchitectureView | None
    requests: tuple[RequestRow, ...]     # finished since the previous tick, newest last
    point: ChartPoint
    status: str = ""
    models: tuple[ModelRow, ...] = ()    # the models served, by their Ollama names (empty: not told)


@dataclass(frozen=True)
class ModelRow:
    """One model a service serves, as the app lists it: its Ollama name, its role (chat, embedding) and its
    state (loaded, loading, unloaded)."""
    name: str
    role: str
    state: str


@dataclass(frozen=True)
class ChatStats:
    """Under a chat reply: its timings, the architecture that served it and the KV handoff."""
    mode: str
    ttft_ms: float | None
    tpot_ms: float | None
    n_prompt_tokens: int | None
    n_output_tokens: int
    finish_reason: str | None
    kv_bytes: int | None = None
    kv_transfer_ms: float | None = None
    error: str | None = None
    n_cached_tokens: int | None = None  # prompt tokens reused from a cached prefix (None: not reported)


@dataclass(frozen=True)
class AdviseStep:
    """Where an advise campaign is (``homepd.advise.campaign.run.Progress``, plus the candidate it measures)."""
    done: int
    total: int
    current: str
    candidate: str | None
    elapsed_s: float
    eta_s: float | None


@dataclass(frozen=True)
class EvidenceRow:
    """A candidate on a prompt mix: medians (live) or means (stored) over the repeats."""
    candidate: str
    mix: str
    n_repeats: int = 0
    goodput_per_s: float | None = None
    slo_attainment: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    itl_ms_max: float | None = None
    output_tok_s: float | None = None
    interference: float | None = None
    kv_transfer_ms: float | None = None
    pss_mib: float | None = None
    infeasible: str | None = None        # why it was not measured


@dataclass(frozen=True)
class RecommendationView:
    candidate: str | None
    config: dict
    rule: str
    reason: str
    confidence: str
    confidence_why: str
    per_mix: tuple[tuple[str, str], ...] = ()    # (mix, candidate)


@dataclass(frozen=True)
class AdviseView:
    """An advise run's evidence and answer, live or from the store."""
    run_id: int | None
    title: str
    rows: tuple[EvidenceRow, ...]
    recommendation: RecommendationView | None
    notes: tuple[str, ...] = ()
    pictures: Pictures | None = None        # capacity curves, latencies, the two-box projection (None: not drawn)
    ttft_budget_ms: float | None = None     # the interactive budgets the pictures mark
    itl_budget_ms: float | None = None

    @property
    def mixes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.mix for r in self.rows if r.infeasible is None))


@dataclass(frozen=True)
class RunListRow:
    run_id: int
    kind: str
    status: str
    started: str
    n_results: int
    candidates: str
    recommendation: str
