"""The architectures an engine can serve with, and the roles its workers play.

Both are ``StrEnum``s: they compare, hash and print as their value, so JSON, config files and CLI text
read ``"colocated"``, ``"disaggregated"``, ``"replicas"`` and ``"prefill"`` exactly as before.  What a mode
*does* (its workers, its entry worker, its failure rule...) is its topology: ``homepd.engine.topology``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.StrEnum):
    COLOCATED = "colocated"           # one worker prefills and decodes (chunked prefill)
    DISAGGREGATED = "disaggregated"   # a prefill worker hands each request's KV to a decode worker
    REPLICAS = "replicas"             # several colocated workers, each with its own model copy


class Role(enum.StrEnum):
    """What a worker process does; a worker's *name* is its role, or ``replica-N`` (role colocated)."""
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Candidate:
    """One configuration advise measures: an architecture and its parameters (its topology names them)."""
    name: str                       # e.g. "colocated-chunk-64", "colocated-adaptive", "disaggregated", "replicas-2"
    mode: Mode
    chunk: int | None = None        # prefill chunk (None = unchunked)
    n_replicas: int | None = None
    feasible: bool = True
    reason: str = ""                # why it is in the list (or why it cannot run here)
    adaptive_chunk: bool = False    # each step's prompt budget kept to the ITL budget (``chunk``: its largest)
    local_prefill: bool = False     # disaggregated: learned routing (a short prompt may stay on the decode worker)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))  # as read back from the store: a plain string

    def config_values(self) -> dict:
        """The ``EngineConfig`` fields this candidate sets: enough to reproduce it from a config file (the
        mode, the chunk or the adaptive chunk, the routing of a disaggregated one, the replica count)."""
        out: dict = {"mode": self.mode, "chunk": self.chunk, "adaptive_chunk": self.adaptive_chunk}
        if self.mode is Mode.DISAGGREGATED:
            out["local_prefill"] = self.local_prefill
        if self.n_replicas is not None:
            out["n_replicas"] = self.n_replicas
        return out
