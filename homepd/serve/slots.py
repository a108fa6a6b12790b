"""One configured model of a service at run time: its state, its engine (or embedder), its figures.

A ``ModelSlot`` goes unloaded -> loading -> loaded -> draining -> unloaded (``ModelState``), changed here
only (``begin_load``, ``loaded``, ``load_failed``, ``begin_unload``, ``unloaded``), each change timestamped.
It counts its leases (requests waiting for it or running on it: ``n_in_flight``), which keep it from being
evicted, and its loads, evictions, load seconds and uses, which the planner (``homepd.models.planner``) and
``/status`` and ``/metrics`` read.  What loads and evicts it is the registry (``homepd.serve.registry``).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from homepd.config import EngineConfig
from homepd.config.models import ModelRole, ModelSpec
from homepd.engine.embedder import EmbeddingModel, ModelState
from homepd.models.card import ModelCard
from homepd.models.footprint import Footprint
from homepd.models.planner import Resident

KEPT_STORE_SUFFIX = ":kv-store"  # the planner's name of a model's kept KV store


@dataclass(frozen=True)
class LoadEvent:
    """One load (or failed load) of a model, with why it happened: for the log, ``/status`` and ``/events``."""
    model: str
    reason: str                 # "start", "request", "evicted a to fit b: ..."
    ok: bool
    load_s: float
    footprint_bytes: int | None
    error: str | None = None
    unix_s: float = 0.0

    def to_dict(self) -> dict:
        return {"model": self.model, "reason": self.reason, "ok": self.ok, "load_s": round(self.load_s, 3),
                "footprint_bytes": self.footprint_bytes, "error": self.error, "unix_s": self.unix_s}


class ModelSlot:
    def __init__(self, spec: ModelSpec, card: ModelCard, config: EngineConfig | None):
        self.spec, self.card = spec, card
        self.config = config                        # the chat engine's settings (None: an embedding model)
        self.state = ModelState.UNLOADED
        self.state_since_s = time.monotonic()
        self.engine = None                          # the chat model's Engine while loaded
        self.model_path: str | None = None          # its file, as its last load resolved it
        self.kv_store_bytes = 0                     # its engine's KV store size (counted whole in its footprint)
        self.measured_s = 0.0                       # when its footprint was last measured (monotonic)
        self.kept_store = None                      # unloaded: the KV store its engine kept, with its prefixes
        self.embedder: EmbeddingModel | None = None  # the embedding model's handle (it loads itself)
        self.footprint: Footprint | None = None     # what the plan counts (measured, estimated or declared)
        self.n_loads = self.n_evictions = self.n_load_failures = self.n_uses = 0
        self.load_s_total = 0.0
        self.last_load_s: float | None = None
        self.last_used_s = 0.0                      # monotonic
        self.last_used_unix_s: float | None = None
        self.n_in_flight = 0
        self.error: str | None = None               # why the last load failed
        self.failed_s: float | None = None          # when (monotonic)
        self.loading: asyncio.Future | None = None  # the load under way (single flight)
        self.unloading: asyncio.Future | None = None
        self.keep_alive_s: float | None = spec.keep_alive_s   # after its last request (a request may shorten it)
        self.expires_at_unix_s: float | None = None
        self.expiry: asyncio.Task | None = None
        self.is_pinned = spec.is_pinned

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_chat(self) -> bool:
        return self.spec.role is ModelRole.CHAT

    @property
    def is_resident(self) -> bool:
        """Holds (or is about to hold) memory: loading, loaded or draining."""
        return self.current_state() is not ModelState.UNLOADED

    def current_state(self) -> ModelState:
        if not self.is_chat and self.embedder is not None and self.state is not ModelState.DRAINING:
            return self.embedder.state  # why: the embedder loads itself and unloads when its keep-alive ends
        return self.state

    # the lifecycle: the one place its state changes ---------------------------------------
    def _set(self, state: ModelState) -> None:
        self.state, self.state_since_s = state, time.monotonic()

    def begin_load(self) -> None:
        assert self.state is ModelState.UNLOADED, self.state
        self.error = None
        self._set(ModelState.LOADING)

    def loaded(self, load_s: float, footprint: Footprint) -> None:
        self.count_load(load_s)
        self.footprint = footprint
        self._set(ModelState.LOADED)

    def count_load(self, load_s: float) -> None:
        """A load done in ``load_s`` (the chat engine's, or the embedder's, which keeps its own state)."""
        self.n_loads += 1
        self.load_s_total += load_s
        self.last_load_s = load_s

    def load_failed(self, error: str, is_failure: bool = True) -> None:
        """The load ended without a model: a failure (its file, its workers: counted, and retried only
        after ``LOAD_RETRY_S``), or a load cancelled or refused for room (``is_failure`` False)."""
        if is_failure:
            self.n_load_failures += 1
            self.error, self.failed_s = error, time.monotonic()
        self.engine = None
        if self.state is ModelState.LOADING:
            self._set(ModelState.UNLOADED)

    def begin_unload(self, is_eviction: bool) -> None:
        self.n_evictions += is_eviction
        self.cancel_expiry()
        self._set(ModelState.DRAINING)

    def unloaded(self) -> None:
        self.engine = None
        self.expires_at_unix_s = None
        self._set(ModelState.UNLOADED)

    # leases -------------------------------------------------------------------------------
    def lease(self) -> None:
        self.n_in_flight += 1
        self.cancel_expiry()

    def used(self, now_s: float) -> None:
        self.n_uses += 1
        self.last_used_s, self.last_used_unix_s = now_s, time.time()

    def cancel_expiry(self) -> None:
        if self.expiry is not None and self.expiry is not asyncio.current_task():
            self.expiry.cancel()
        self.expiry = None
        self.expires_at_unix_s = None

    # as the planner and the faces see it ---------------------------------------------------------
    @property
    def kept_store_bytes(self) -> int:
        """What the KV store kept from its last engine holds (its saved prefixes' extents)."""
        book = self.kept_store
        return sum(e.extent_bytes for entries in book.entries.values() for e in entries.values()) if book else 0

    def kept_store_resident(self) -> Resident:
        """The kept KV store as the planner sees it: memory that frees at no reload cost (its prefixes are
        then prefilled again)."""
        return Resident(self.name + KEPT_STORE_SUFFIX, self.kept_store_bytes, reload_s=0.0,
                        last_used_s=self.last_used_s, n_uses=self.n_uses)

    def resident(self) -> Resident:
        return Resident(self.name, self.footprint.footprint_bytes if self.footprint else 0,
                        is_pinned=self.is_pinned, n_in_flight=self.n_in_flight,
                        is_loading=self.current_state() is ModelState.LOADING,
                        reload_s=self.footprint.load_s if self.footprint and self.footprint.load_s else
                        self.last_load_s, last_used_s=self.last_used_s, n_uses=self.n_uses)

    def to_dict(self) -> dict:
        fp = self.footprint
        return {"name": self.name, "role": self.spec.role.value, "state": self.current_state().value,
                "aliases": list(self.card.aliases), "pinned": self.is_pinned,
                "n_ctx": self.config.n_ctx if self.config else self.card.context_length,
                "footprint_bytes": fp.footprint_bytes if fp else None,
                "footprint_source": fp.source.value if fp else None,
                "estimate_bytes": fp.estimate_bytes if fp else None,
                "in_flight": self.n_in_flight, "loads": self.n_loads, "evictions": self.n_evictions,
                "load_failures": self.n_load_failures, "load_seconds_total": round(self.load_s_total, 3),
                "last_load_s": self.last_load_s, "uses": self.n_uses, "last_used_unix_s": self.last_used_unix_s,
                "kept_kv_store_bytes": self.kept_store_bytes, "keep_alive_s": self.keep_alive_s, "expires_at_unix_s": self.expires_at_unix_s,
                "error": self.error}
