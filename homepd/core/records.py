"""Typed records that cross layers: what the engine reports, what the store keeps, what faces show.

Plain frozen dataclasses and enums (standard library only).  ``to_dict`` gives
the JSON shape used by ``--json`` output, the HTTP status route and the store.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI's ``finish_reason`` vocabulary plus homepd's two)."""
    STOP = "stop"            # end-of-generation token or a stop string
    LENGTH = "length"        # max_tokens (or the context) reached
    CANCELLED = "cancelled"  # the caller cancelled it (or disconnected)
    ERROR = "error"          # failed: the error says why

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
    resumed_from_slot: tuple[str, ...] = ()
    recomputed_requests: tuple[str, ...] = ()
    recovery_s: float | None = None     # RESTARTED: death -> replacement ready

    def to_dict(self) -> dict:
        return to_plain(self)


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

    def to_dict(self) -> dict:
        return to_plain(self)


@dataclass(frozen=True)
class KVSlotsSnapshot:
    n_slots: int
    capacity_bytes: int
    occupancy: dict[str, int]           # slot state name -> count
    in_slot: tuple[str, ...]            # request ids whose KV waits in a slot

    @property
    def total_bytes(self) -> int:
        return self.n_slots * self.capacity_bytes

    def to_dict(self) -> dict:
        return to_plain(self)


@dataclass(frozen=True)
class EngineSnapshot:
    """A picture of a running engine: workers, queues, KV slots, requests by state, recent worker events."""
    mode: str
    model: str | None
    n_ctx: int
    chunk: int | None
    workers: tuple[WorkerSnapshot, ...]
    kv_slots: KVSlotsSnapshot | None
    requests: dict[str, tuple[str, ...]]  # lifecycle state value -> request ids
    n_steps: int
    worker_events: tuple[WorkerEvent, ...]
    t_s: float = 0.0

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


def to_plain(obj):
    """Dataclasses, enums and tuples -> JSON-ready dicts, strings and lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj
