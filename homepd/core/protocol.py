"""Typed messages between the controller and worker processes (pickled over a Pipe).

Small frozen dataclasses, never method names as strings.  Times are
``time.monotonic()`` seconds, comparable across processes on one box.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import dataclass, field
from enum import Enum

from homepd.core.terms import RequestClass, ReuseMode, StepEstimate
from homepd.core.modes import Role
from homepd.core.records import FinishReason, PrefixCacheStats
from homepd.core.sampling import SamplingParams, TokenLogprob


# the modules whose types cross a worker's pipe (pickled): both ends must run the same ones
WIRE_MODULES = ("homepd.core.protocol", "homepd.core.records", "homepd.core.terms", "homepd.core.sampling",
                "homepd.core.modes")


@functools.cache
def wire_fingerprint() -> str:
    """A hash of the source of the modules whose types cross the pipe (``WIRE_MODULES``): what the controller and
    a worker must share to speak.  A package upgraded in place under a running service changes it, and a worker
    then started (a restart) runs code its controller does not speak; it says so (``worker_mismatch``) instead of
    failing on a message neither side can read."""
    digest = hashlib.sha256()
    for name in WIRE_MODULES:
        with open(importlib.util.find_spec(name).origin, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:16]


def worker_mismatch(controller_wire: str) -> str | None:
    """Why a worker cannot serve a controller whose ``wire_fingerprint`` is ``controller_wire``, or None."""
    if controller_wire == wire_fingerprint():
        return None
    return (f"version mismatch: this worker's homepd code (wire {wire_fingerprint()}) is not its controller's "
            f"(wire {controller_wire or 'unknown'}): the package was changed under the running service; "
            "restart the service to run the new version")


# what a worker is started with --------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    model_path: str
    n_ctx: int
    n_seq_max: int
    chunk: int | None
    n_threads: int
    cpu_cores: tuple[int, ...] | None = None
    n_gpu_layers: int = 0
    fault: str | None = None
    cuda_visible_devices: str = ""      # "" hides every GPU; else an index or UUID
    model_fingerprint: str = ""        # identity checked on every KV extent (disaggregation)
    backend: str = "llama"             # "llama" or "fake" (homepd.fakellm: tests without a model)
    wire: str = ""                     # the controller's wire_fingerprint(): the worker checks it first
    # adaptive chunk: each step's prompt budget keeps interactive decodes within this ITL (None: fixed chunk,
    # which is then also the largest adaptive budget)
    itl_budget_ms: float | None = None
    # adaptive chunk: the longest step when no interactive stream decodes (steppolicy.IDLE_STEP_SHARE_OF_TTFT)
    idle_step_ms: float | None = None
    # adaptive chunk: the longest gap a step granted to a TTFT deadline may make (None: never granted)
    gap_ceiling_ms: float | None = None
    # prefix reuse (homepd.core.prefixreuse): finished sequences' KV kept up to this many cells (0: off)
    max_cached_cells: int = 0
    # sequence ids beyond n_seq_max, which only paused prefills hold (homepd.core.allocator, --cached-seqs)
    n_cached_ids: int = 0
    # sequences that may run beyond n_seq_max, each started as a prompt while every other id ran (--prefill-seqs)
    n_prefill_ids: int = 0
    # the KV layout (--kv-layout): one pool every sequence draws from, or one stream of n_ctx / n_ids cells per id
    kv_unified: bool = True
    # llama.cpp's flash attention, one setting for every worker of an engine (the V cache's layout follows it,
    # and workers trade KV state): homepd.engine.specs.flash_attn
    flash_attn: bool = False

    @property
    def n_batch(self) -> int:
        # why: llama.cpp clamps n_batch to the n_ctx asked for; a larger plan would abort llama_decode
        # (a prefill worker's context can be smaller than the chunk)
        return self.n_ctx if self.chunk is None else max(min(self.chunk, self.n_ctx), self.n_running_max)

    @property
    def n_running_max(self) -> int:
        """The most sequences that run (decode) at once: ``n_seq_max`` and the prompts started beyond it."""
        return self.n_seq_max + self.n_prefill_ids

    @property
    def n_ids(self) -> int:
        """The llama.cpp context's sequence ids: the running ones and those for cached prefixes."""
        return self.n_running_max + self.n_cached_ids

    @property
    def offload_layers(self) -> int:
        """The layers its model offloads: ``n_gpu_layers`` where it is given a GPU, else 0 (a CPU worker)."""
        return self.n_gpu_layers if self.cuda_visible_devices else 0

    @property
    def decodes(self) -> bool:
        """Whether this worker decodes (a prefill worker only prefills, then hands the KV off)."""
        return self.role != Role.PREFILL

    @property
    def step_itl_budget_ms(self) -> float | None:
        """The ITL budget its step policy keeps for the streams it decodes (None: fixed chunk, or no decodes)."""
        return self.itl_budget_ms if self.decodes else None

    @property
    def step_gap_ceiling_ms(self) -> float | None:
        """The gap ceiling its step policy may grant to a TTFT deadline (None: none, as without an ITL budget)."""
        return self.gap_ceiling_ms if self.step_itl_budget_ms is not None else None


@dataclass(frozen=True)
class RolePlacement:
    """Where one worker role runs: pinned CPUs, threads, GPU (a CUDA_VISIBLE_DEVICES value) and offload;
    ``n_ctx``: the role's own context when it differs from the engine's (the prefill worker's)."""
    cpu_cores: tuple[int, ...] | None
    n_threads: int
    cuda_visible_devices: str | None = None
    n_gpu_layers: int = 0
    n_ctx: int | None = None


@dataclass(frozen=True)
class EngineSetup:
    """What an engine starts with, resolved by its caller (``homepd.launch``) before ``Engine.start``:
    a checked model file, its fingerprint, the placement of each worker role and, for disaggregation,
    the KV arena's size in bytes."""
    model_path: str
    model_fingerprint: str
    placements: dict[str, RolePlacement]
    kv_arena_bytes: int | None = None
    kv_store_bytes: int = 0  # the KV store tier, split among the workers with a prefix cache (0: none)


# controller -> worker ----------------------------------------------------------
@dataclass(frozen=True)
class SubmitRequest:
    """A tokenized request for the worker's waiting queue.

    A request resumed by recompute (its KV died with a worker) comes back with
    its earlier output appended to ``prompt_ids``, the remaining ``max_tokens``,
    and ``stream``: the text stream rebuilt from that output (held-back text
    and partial UTF-8 included), so text and stop strings continue seamlessly.
    """
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: object | None = None   # homepd.chat.textstream.TextStream
    request_class: RequestClass = RequestClass.INTERACTIVE
    deadline_s: float | None = None  # first token due (monotonic): arrival + the class's TTFT budget
    # a resumed request's earlier output (the tail of prompt_ids): its new sampler replays them (penalties, grammar)
    history_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "request_class", RequestClass(self.request_class))


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# worker -> controller ----------------------------------------------------------
@dataclass(frozen=True)
class WorkerReady:
    """Sent once the model and context are loaded."""
    pid: int
    role: str
    model_size_bytes: int
    n_ctx: int
    load_s: float
    state_bytes_per_token: int = 0   # KV state growth per token (llama_state_seq_get_size)
    state_overhead_bytes: int = 0    # KV state size of an empty-ish sequence, without the tokens
    # (phase, start address, end address) of the large private mappings made by loading the model ("model")
    # and creating the context ("context"), and the context's resident bytes right after creation (its KV
    # cache): homepd.hw.smaps, measured by the controller
    memory_regions: tuple[tuple[str, int, int], ...] = ()
    kv_cache_bytes: int = 0
    prefix_cache_mode: ReuseMode = ReuseMode.OFF  # what its prefix cache reuses (PrefixCacheStats.mode)
    wire: str = ""                   # its wire_fingerprint(): the controller checks it is its own


@dataclass(frozen=True)
class StepRecord:
    """One llama_decode step: what shared it and how long it took (the step log)."""
    worker_role: str
    index: int
    t_start_s: float
    t_end_s: float
    decode_request_ids: tuple[str, ...]
    prefill: tuple[tuple[str, int], ...]  # (request_id, prompt tokens in this step)
    budget: int = 0                       # the prompt-token budget the step policy gave this step
    kv_in_use: int = 0                    # KV cells its tokens attend over (``Scheduler._attended``)
    granted_to: str | None = None         # a step past the ITL budget: the prompt whose TTFT deadline needed it
    grant_lost: bool = False              # that prompt's deadline was lost anyway: a step at the gap ceiling
    store_ms: float = 0.0                 # KV store saves and restores run since the previous step (streams waited)
    n_waiting_for_id: int = 0             # prompts left waiting by it because every sequence id was held

    @property
    def n_decode_tokens(self) -> int:
        return len(self.decode_request_ids)

    @property
    def n_prompt_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def duration_ms(self) -> float:
        return (self.t_end_s - self.t_start_s) * 1e3


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    token_id: int
    text: str
    t_s: float
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities


@dataclass(frozen=True)
class RequestDone:
    """A request left the worker: finished (``STOP``, ``LENGTH``), ``CANCELLED``, or failed (``ERROR``, error set)."""
    request_id: str
    reason: FinishReason
    t_s: float
    text: str = ""  # text held back until the end (stop-string look-ahead)
    error: str | None = None
    kv_full: bool = False  # it ended with LENGTH because the KV context was full, not at its max_tokens (kvpolicy)

    def __post_init__(self):
        object.__setattr__(self, "reason", FinishReason(self.reason))  # an unknown reason fails here, in the worker


@dataclass(frozen=True)
class KVPreempted:
    """The full KV context took a request's cells back (``homepd.core.kvpolicy``): the worker dropped its KV
    and re-queued it with its output so far as prompt, to be recomputed there; its stream pauses, loses nothing."""
    request_id: str
    t_s: float
    n_tokens: int  # prompt + output so far: what will be prefilled again


class CacheSource(str, Enum):
    """Where a reused prompt prefix came from."""
    CONTEXT = "context"  # cells kept in the worker's llama.cpp context
    STORE = "store"      # restored from the host-memory KV store


@dataclass(frozen=True)
class PrefixReused:
    """A request's prompt starts from a reused prefix: ``n_tokens`` prompt tokens are not computed."""
    request_id: str
    n_tokens: int
    source: CacheSource
    t_s: float

    def __post_init__(self):
        object.__setattr__(self, "source", CacheSource(self.source))


@dataclass(frozen=True)
class StepReport:
    """One step's record and what it moved, and the worker's step-time model after it: the estimate its own
    step policy budgets with (None until the model has seen enough steps), which the controller's admission
    gate reads instead of fitting a model of its own.  The budget the policy gave is ``step.budget``."""
    step: StepRecord
    prefill_started: tuple[str, ...] = ()
    prefill_ended: tuple[str, ...] = ()
    tokens: tuple[TokenOut, ...] = ()
    done: tuple[RequestDone, ...] = field(default=())
    estimate: StepEstimate | None = None
    cache: PrefixCacheStats | None = None  # the worker's prefix cache after the step (None: it has none)


@dataclass(frozen=True)
class Heartbeat:
    """Sent while a worker holds requests but has no step to run (e.g. waiting for a KV extent):
    it is alive, not hung."""
    t_s: float


@dataclass(frozen=True)
class WorkerFatal:
    """The worker hit an unrecoverable error and is exiting."""
    error: str


# disaggregation: KV handoff through the shared-memory KV arena -----------------------
@dataclass(frozen=True)
class AttachExtents:
    """Controller -> prefill and decode workers: the KV arena to attach to.

    For a (re)started prefill worker, which allocates the arena's extents:
    ``live_extents`` (offset, bytes) are still in use by requests in transit,
    and at most ``max_extents`` may be in use at once (None: only bytes bound it).
    """
    names: tuple[str, ...]
    live_extents: tuple[tuple[int, int], ...] = ()
    max_extents: int | None = None


@dataclass(frozen=True)
class KVHandoff:
    """A request whose prompt is done and whose KV state sits in the arena extent at ``offset``.

    Prefill worker -> controller when exported; controller -> decode worker to
    import.  Carries everything the decode side needs to continue the request
    exactly: outputs so far (the decode side builds the request's sampler again from ``params`` and them:
    ``homepd.llm.sampler``) and the text stream (held-back text and partial UTF-8).
    """
    request_id: str
    offset: int            # of the extent, in the arena's data region
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    params: SamplingParams
    stream: object         # homepd.chat.textstream.TextStream
    n_bytes: int           # llama_state_seq_get_size: the payload
    n_tokens: int
    extent_wait_s: float   # prompt done -> extent allocated (back-pressure)
    export_start_s: float
    export_end_s: float
    extent_bytes: int = 0      # header + payload, whole pages: what the extent takes
    arena_used_bytes: int = 0  # the allocator's bytes in use once this extent was taken
    arena_kv_bytes: int = 0    # payload bytes of every live extent then (this one included)
    request_class: RequestClass = RequestClass.INTERACTIVE  # its budgets follow it to the decode worker

    def __post_init__(self):
        object.__setattr__(self, "request_class", RequestClass(self.request_class))


@dataclass(frozen=True)
class KVImported:
    """Decode worker -> controller: the request's KV is loaded; its extent is free again."""
    request_id: str
    offset: int            # of the extent it was imported from
    import_start_s: float
    import_end_s: float


@dataclass(frozen=True)
class ExtentFreed:
    """Controller -> prefill worker: arena bytes may be free again (wakes a waiting export);
    ``offset``: the extent's, -1 when unknown."""
    offset: int


# the KV store tier (homepd.kv.store): prefixes evicted from a worker's context, in host shared memory ----------
@dataclass(frozen=True)
class AttachStore:
    """Controller -> worker: its KV store segment, and the entries it holds (offset, extent bytes, payload
    bytes, tokens), as that worker (or the one it replaces) reported them."""
    names: tuple[str, ...]
    entries: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class StoreSaved:
    """Worker -> controller: a prefix evicted from its context is saved in its store segment at ``offset``."""
    offset: int
    extent_bytes: int
    payload_bytes: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class SaveCachedPrefixes:
    """Controller -> worker: save every prefix cached in the context into the store (the model is about to be
    unloaded, its store kept for its next load); answered with ``CachedPrefixesSaved``."""


@dataclass(frozen=True)
class CachedPrefixesSaved:
    """Worker -> controller: the cached prefixes are in the store (``n_entries`` of the context's were offered;
    each saved one was reported with ``StoreSaved``)."""
    n_entries: int


@dataclass(frozen=True)
class StoreDropped:
    """Worker -> controller: these store entries are gone (evicted for room, or superseded)."""
    offsets: tuple[int, ...]
