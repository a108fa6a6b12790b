"""The architectures an engine can serve with, and the roles its workers play.

Both are ``StrEnum``s: they compare, hash and print as their value, so JSON, config files and CLI text
read ``"colocated"``, ``"disaggregated"``, ``"replicas"`` and ``"prefill"`` exactly as before.  What a mode
*does* (its workers, its entry worker, its failure rule...) is its topology: ``homepd.engine.topology``; what
advise, export and the app need to know of it is its ``ModeTraits`` (``Mode.traits``), declared here once.
A new mode is this enum's member and its traits, its topology, and the topology's registration.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.StrEnum):
    COLOCATED = "colocated"           # one worker prefills and decodes (chunked prefill)
    DISAGGREGATED = "disaggregated"   # a prefill worker hands each request's KV to a decode worker
    REPLICAS = "replicas"             # several colocated workers, each with its own model copy

    @property
    def traits(self) -> "ModeTraits":
        return _TRAITS[self]


@dataclass(frozen=True)
class ModeTraits:
    """What the layers above the engine (advise, export, the app) need to know of a mode.  Every mode
    declares every trait, so no rule above the engine falls back to another mode's behaviour."""
    hands_off_kv: bool               # a prefill worker hands each request's KV to a decode worker (the arena)
    single_worker: bool              # one worker prefills and decodes: where chunking's interference shows
    quick: bool                      # measured by ``advise --quick`` (the product's question: chunked or split)
    config_fields: tuple[str, ...]   # the EngineConfig fields its candidates set besides mode and the chunk


_TRAITS = {
    Mode.COLOCATED: ModeTraits(hands_off_kv=False, single_worker=True, quick=True, config_fields=()),
    Mode.DISAGGREGATED: ModeTraits(hands_off_kv=True, single_worker=False, quick=True,
                                   config_fields=("local_prefill",)),
    Mode.REPLICAS: ModeTraits(hands_off_kv=False, single_worker=False, quick=False, config_fields=("n_replicas",)),
}


def check_traits(traits: dict) -> None:
    """Every mode has its traits: a mode without them is an error at import, not a fallback at run time."""
    if missing := sorted(set(Mode) - set(traits)):
        raise TypeError(f"modes without ModeTraits: {', '.join(missing)}")


check_traits(_TRAITS)


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
        out.update({name: getattr(self, name) for name in self.mode.traits.config_fields
                    if getattr(self, name) is not None})
        if self.mode.traits.hands_off_kv:
            # why: its workers' KV is one pool (a handoff between contexts of different sizes); a base config asking
            # for per-sequence streams would refuse this candidate
            out["kv_layout"] = "unified"
        return out
