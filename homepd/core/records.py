"""Typed records that cross layers: what the engine reports, what the store keeps, what faces show.

Plain frozen dataclasses and enums (standard library only).  ``to_dict`` gives the JSON shape used by ``--json``
output, the HTTP status route and the store; ``EngineSnapshot.from_dict`` (``from_plain``) reads that shape back,
strictly, where JSON comes in (the app's HTTP edge).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field

from homepd.core.terms import RequestClass, ReuseMode
from homepd.errors import HomepdError


OLD_NAME = "old_name"  # field metadata: the name a renamed field had in JSON (``renamed_from``)


def renamed_from(old: str) -> dict:
    """Metadata for a field renamed after its JSON was out (``field(metadata=renamed_from("old"))``):
    ``to_plain`` writes it under both names, the new one first, so readers of the old name keep reading
    it; ``from_plain`` and ``from_stored`` read either (the new one when both are there)."""
    return {OLD_NAME: old}


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI's ``finish_reason`` vocabulary plus homepd's two)."""
    STOP = "stop"            # end-of-generation token or a stop string
    LENGTH = "length"        # max_tokens (or the context) reached
    CANCELLED = "cancelled"  # the caller cancelled it (or disconnected)
    ERROR = "error"          # failed: the error says why

    def __str__(self) -> str:  # why: f-strings and metric labels show the value ("stop"), as the string did
        return self.value

    @classmethod
    def parse(cls, value: "str | FinishReason | None") -> "FinishReason | None":
        return None if value is None else cls(value)


class WorkerEventKind(str, enum.Enum):
    DIED = "died"            # the process ended (crash, kill -9, killed as hung)
    RESTARTED = "restarted"  # a replacement is ready
    FAILED = "failed"        # could not be restarted: the engine refuses new work


@dataclass(frozen=True)
class WorkerEvent:
    """A worker death, restart or final failure, with what happened to the requests it held."""
    kind: WorkerEventKind
    role: str
    pid: int | None
    t_s: float                          # time.monotonic()
    exitcode: int | None = None
    cause: str = ""
    crash_loop: bool = False
    failed_requests: tuple[str, ...] = ()
    resumed_from_extent: tuple[str, ...] = field(  # re-imported from their arena extent; JSON: under its
        default=(), metadata=renamed_from("resumed_from_slot"))  # old name too
    recomputed_requests: tuple[str, ...] = ()
    recovery_s: float | None = None     # RESTARTED: death -> replacement ready

    def to_dict(self) -> dict:
        return to_plain(self)


@dataclass(frozen=True)
class PrefixCacheStats:
    """One worker's prefix cache: cumulative counters since the worker started, and its current size."""
    n_lookups: int = 0            # prompts looked up
    n_hits: int = 0               # lookups that reused at least one token
    n_lookup_tokens: int = 0      # prompt tokens looked up
    n_hit_tokens: int = 0         # of those, tokens reused (not computed)
    n_evictions: int = 0          # cached prefixes dropped to make room
    n_cached_entries: int = 0     # cached prefixes held now
    n_cached_cells: int = 0       # KV cells they hold now (not counting cells shared with running requests)
    cached_bytes: int = 0         # those cells in bytes
    n_store_entries: int = 0      # KV store tier (host memory), when there is one: entries held now
    store_bytes: int = 0          # bytes their extents take in the store (headers included)
    n_store_hits: int = 0         # of the hits, prompts restored from the store
    n_store_hit_tokens: int = 0   # tokens they restored
    n_store_no_room: int = 0      # saves refused because /dev/shm had no room for their pages
    n_pauses: int = 0             # prefills that gave their sequence id to an interactive prompt ahead (KV kept)
    n_pause_resumed_tokens: int = 0  # prompt tokens those took back resuming (not computed, and not hits)
    store_capacity_bytes: int = 0    # the KV store tier's bytes for this worker (0: no store attached)
    store_save_ms_per_token: float | None = None     # its saves' cost per token (None: none yet)
    store_save_base_ms: float | None = None          # ... and their fixed part (None: none yet, or not measured)
    store_restore_ms_per_token: float | None = None  # its restores' cost per token, averaged (None: none yet)
    mode: ReuseMode = ReuseMode.OFF  # what llama.cpp allows for this cache type (off, any prefix, exact)

    @property
    def hit_ratio(self) -> float | None:
        """Share of looked-up prompt tokens that were reused (None before any lookup)."""
        return self.n_hit_tokens / self.n_lookup_tokens if self.n_lookup_tokens else None


@dataclass(frozen=True)
class WorkerSnapshot:
    role: str
    pid: int | None
    alive: bool
    ready: bool
    restarts: int
    n_threads: int
    cpu_cores: tuple[int, ...] | None
    cuda_visible_devices: str
    n_gpu_layers: int
    in_flight: tuple[str, ...]
    backlog: int
    failed: str | None = None
    flash_attn: bool = False  # llama.cpp's flash attention in its context (WorkerSpec.flash_attn)

    def to_dict(self) -> dict:
        return to_plain(self)


@dataclass(frozen=True)
class KVArenaSnapshot:
    """The KV arena of a disaggregated engine (one shared segment of ``capacity_bytes``) and the requests whose
    KV is in transit through it, one extent each (``homepd.kv.pool``)."""
    capacity_bytes: int
    max_extents: int | None             # extents live at once (the handoff back-pressure bound); None: no cap
    occupancy: dict[str, int]           # extent state name -> extents, over the requests in transit
    in_arena: tuple[str, ...]           # request ids whose KV waits in the arena
    used_bytes: int = 0                 # arena bytes their extents hold (headers and page rounding included)
    in_transit_kv_bytes: int = 0        # their KV payload bytes
    peak_used_bytes: int = 0            # most arena bytes in use at once since the engine started
    peak_kv_bytes: int = 0              # KV payload bytes in transit at that moment
    prefill_n_ctx: int = 0              # the prefill worker's context (longer prompts prefill on decode)

    @property
    def n_extents(self) -> int:
        return sum(self.occupancy.values())

    def to_dict(self) -> dict:
        return to_plain(self)


@dataclass(frozen=True)
class ProcessMemoryBreakdown:
    """One homepd process's PSS by what holds it (bytes).  Shared mappings are this process's share."""
    role: str                     # "controller", "colocated", "prefill", "decode", "replica-N"
    pid: int
    pss_bytes: int
    weights_mapped_bytes: int     # its share of the model file's mapped pages
    weights_copied_bytes: int     # private memory the model load made (repacked weights, vocabulary)
    kv_cache_bytes: int           # llama.cpp's KV cache
    compute_bytes: int            # llama.cpp's compute and output buffers, as far as steps touched them
    arena_bytes: int              # its share of the KV arena
    rest_bytes: int               # interpreter, libraries, heaps
    kv_store_bytes: int = 0       # its share of the KV store tier's segments (homepd.kv.store)


@dataclass(frozen=True)
class MemoryBreakdown:
    """The memory of every homepd process (controller, workers, KV arena) by what holds it, each byte
    counted once: the model file's pages and the arena, mapped by several processes, count once at
    their largest resident size; the rest is each process's own (bytes, resident in RAM; VRAM is not in it)."""
    weights_shared_bytes: int     # model file pages mapped in (shared by the processes that map it)
    weights_copied_bytes: int     # summed over processes: one private copy per worker
    kv_cache_bytes: int
    compute_bytes: int
    arena_bytes: int
    rest_bytes: int
    processes: tuple[ProcessMemoryBreakdown, ...] = ()
    kv_store_bytes: int = 0       # the KV store tier's resident pages (mapped by the controller and workers)

    @property
    def total_bytes(self) -> int:
        return (self.weights_shared_bytes + self.weights_copied_bytes + self.kv_cache_bytes + self.compute_bytes
                + self.arena_bytes + self.kv_store_bytes + self.rest_bytes)

    def to_dict(self) -> dict:
        out = to_plain(self)
        out["total_bytes"] = self.total_bytes
        return out


@dataclass(frozen=True)
class ClassQueue:
    """One request class at one moment: what waits for its first token, and what admission decided so far."""
    request_class: RequestClass
    queued_requests: int        # not yet given a first token
    queued_prompt_tokens: int   # of those, prompt tokens not yet prefilled
    running: int                # in the engine (queued or decoding)
    admitted: int               # since the engine started
    deferred: int               # admitted behind queued interactive work (background)
    rejected: int               # refused early: predicted to miss the TTFT budget
    ttft_budget_ms: float
    itl_budget_ms: float | None


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Two queues, two budgets: per-class queues and decisions, each worker's latest prompt budget (the chosen
    chunk) and prefill speed, and how good the TTFT predictions were (finished requests, ms)."""
    classes: tuple[ClassQueue, ...]
    chunk_by_worker: dict[str, int]            # prompt-token budget of the worker's latest step
    prefill_tok_s_by_worker: dict[str, float]  # measured (step-time model), at that budget
    admission: bool                            # early rejection on
    adaptive_chunk: bool
    ttft_error_mean_ms: float | None = None    # mean |predicted - actual|
    ttft_error_p90_ms: float | None = None
    n_predictions: int = 0
    routed_local: int = 0                      # disaggregated: short prompts prefilled on the decode worker
    routed_remote: int = 0                     # ... and prompts sent through the prefill worker and a KV handoff
    route_threshold_tokens: int | None = None  # the latest learned threshold
    routed_by_reason: dict[str, int] = field(default_factory=dict)  # new requests by RouteReason value
    route_predicted_cached_tokens: int = 0     # ended requests: prompt tokens routing expected their worker held
    route_reused_tokens: int = 0               # ... and the tokens those workers reported reusing
    # steps granted past the ITL budget so that a prompt kept its TTFT deadline (a gap granted to a deadline)
    deadline_grants_by_worker: dict[str, int] = field(default_factory=dict)
    # steps run at the gap ceiling for a prompt whose TTFT deadline was lost anyway (steppolicy.lost_grant)
    lost_grants_by_worker: dict[str, int] = field(default_factory=dict)
    # prompt-seconds waited while every sequence id of the worker was held (--n-seq-max requests running)
    id_wait_s_by_worker: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSnapshot:
    """A picture of a running engine: workers, queues, the KV arena, requests by state, recent worker events.

    ``to_dict`` is ``/status``'s ``engine`` object; ``from_dict`` its exact inverse, which raises
    ``RecordShapeError`` on a missing, unknown or mistyped field instead of reading it as 0."""
    mode: str
    model: str | None
    n_ctx: int
    chunk: int | None
    workers: tuple[WorkerSnapshot, ...]
    kv_arena: KVArenaSnapshot | None
    requests: dict[str, tuple[str, ...]]  # lifecycle state value -> request ids
    n_steps: int
    worker_events: tuple[WorkerEvent, ...]
    t_s: float = 0.0
    requests_by_class: dict[str, int] = dataclasses.field(default_factory=dict)  # running + waiting per class
    memory: MemoryBreakdown | None = None  # as last measured (Engine.measure_memory: at start, after each trace)
    admission: AdmissionSnapshot | None = None
    cache: dict[str, PrefixCacheStats] = dataclasses.field(default_factory=dict)  # worker -> its prefix cache
    kv_stream_cells: int | None = None  # each sequence's stream of the KV cache (--kv-layout); None: one pool

    @property
    def n_running(self) -> int:
        return sum(len(ids) for state, ids in self.requests.items() if state != "waiting")

    @property
    def n_waiting(self) -> int:
        return len(self.requests.get("waiting", ()))

    def worker(self, role: str) -> WorkerSnapshot | None:
        return next((w for w in self.workers if w.role == role), None)

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EngineSnapshot":
        return from_plain(cls, data)


def to_plain(obj):
    """Dataclasses, enums and tuples -> JSON-ready dicts, strings and lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            out[f.name] = to_plain(getattr(obj, f.name))
            if OLD_NAME in f.metadata:
                out[f.metadata[OLD_NAME]] = to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj


class RecordShapeError(HomepdError, ValueError):
    """JSON that does not have a record's shape: a missing, unknown or mistyped field (the message names it)."""


def from_plain(cls: type, data):
    """The inverse of ``to_plain`` for the dataclass ``cls``: JSON-ready dicts and lists -> records, tuples and
    enums, checked against the field annotations.  Every field must be present and no other (a renamed field
    fails here, loudly, instead of showing up as 0); raises ``RecordShapeError`` naming the field's path."""
    return _decode(cls, data, cls.__name__)


def from_stored(cls: type, data, path: str | None = None):
    """``from_plain`` for data an older homepd kept on disk: a field that has a default may be missing (the row
    predates it) and gets that default, and a field the record does not know is ignored (it stays on disk); a
    missing field without a default, or a mistyped one, is still a ``RecordShapeError`` naming its path."""
    return _decode(cls, data, path or cls.__name__, stored=True)


def _decode(tp, value, path: str, stored: bool = False):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        assert len(arms) == 1, f"{path}: a union of {arms} cannot be decoded"
        return _decode(arms[0], value, path, stored)
    if dataclasses.is_dataclass(tp):
        _expect(value, dict, path)
        hints = _field_types(tp)
        fields = dataclasses.fields(tp)
        value = _under_new_names(fields, value)
        names = [f.name for f in fields]
        if stored:  # an older row: what it lacks takes the default; what the record does not know stays on disk
            names = [f.name for f in fields if f.name in value or not _has_default(f)]
        missing = [n for n in names if n not in value]
        unknown = [] if stored else sorted(set(value) - set(names))
        if missing or unknown:
            raise RecordShapeError(f"{path}: " + "; ".join(
                part for part in (missing and f"missing field(s) {', '.join(missing)}",
                                  unknown and f"unknown field(s) {', '.join(unknown)}") if part))
        return tp(**{n: _decode(hints[n], value[n], f"{path}.{n}", stored) for n in names})
    if origin is tuple:
        _expect(value, list, path)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{path}[{i}]", stored) for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecordShapeError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_decode(a, v, f"{path}[{i}]", stored) for i, (a, v) in enumerate(zip(args, value)))
    if tp is dict:  # an open-ended JSON object, kept as it is
        _expect(value, dict, path)
        return dict(value)
    if origin is dict:
        _expect(value, dict, path)
        return {_decode(args[0], k, f"{path} key", stored): _decode(args[1], v, f"{path}[{k!r}]", stored)
                for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise RecordShapeError(f"{path}: {value!r} is not a {tp.__name__}") from None
    if tp is float:
        _expect(value, (int, float), path)
        return float(value)
    if tp in (int, str, bool):
        _expect(value, tp, path)
        return value
    raise AssertionError(f"{path}: no decoder for {tp!r}")


def _under_new_names(fields, value: dict) -> dict:
    """``value`` with each renamed field's old key (``renamed_from``) read as its new one (the new key wins
    when both are there) and the old key dropped."""
    renamed = {f.metadata[OLD_NAME]: f.name for f in fields if OLD_NAME in f.metadata}
    if not renamed.keys() & value.keys():
        return value
    out = {k: v for k, v in value.items() if k not in renamed}
    for old, new in renamed.items():
        if old in value and new not in value:
            out[new] = value[old]
    return out


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


@functools.cache
def _field_types(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _expect(value, kind, path: str) -> None:
    # why the bool check: JSON true is not a count, and isinstance(True, int) holds
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RecordShapeError(f"{path}: expected {names}, got {type(value).__name__} {value!r:.40}")
