"""What a model takes: planned before a load, measured after it, and kept in the store.

Before a load (``planned``): the footprint measured here before for the same model file and allocation
(``FootprintKey``: ``n_ctx``, ``n_seq_max``, KV type, placement), from this run or the store's
``model_footprints``, else the planner's estimate from the GGUF header (``homepd.models.planner``).  After a
load (``measured``): every process of the model's engine by what holds its memory (``Engine.measure_memory``),
less the controller's own share, with the KV store counted at its size; recorded.  An idle loaded model is
measured again (``remeasured``), since compute buffers grow with the largest step it ran.  The fake backend
declares its footprint instead (1 MiB and 1 KiB a KV cell), so the logic's tests can set exact budgets.
Every blocking call (prepare, the header, /proc, sqlite) runs off the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time

from homepd.config import EngineConfig
from homepd.engine.embedder import ModelState
from homepd.launch import prepare
from homepd.models.footprint import KV_TYPE, Footprint, FootprintKey, FootprintSource
from homepd.models.gguf import read_gguf_header
from homepd.models.planner import estimate_bytes
from homepd.serve.slots import ModelSlot

log = logging.getLogger("homepd.serve")
KV_BYTES_PER_TOKEN_GUESS = 64 << 10


def fake_footprint_bytes(config: EngineConfig) -> int:
    """The fake backend's declared footprint: 1 MiB of "weights" and 1 KiB a KV cell (deterministic, so the
    logic's tests can set a budget that holds exactly one model)."""
    return (1 << 20) + config.n_ctx * 1024


def estimate_for(config: EngineConfig, setup) -> int:
    """The planner's estimate of a chat model prepared as ``setup`` (reads its GGUF header): the weights once,
    each worker's KV cache for ``n_ctx`` and overhead, with the margin; the KV arena and store at their sizes."""
    header = read_gguf_header(setup.model_path)
    n_workers = len(setup.placements)
    return estimate_bytes(header.size_bytes, header.kv_bytes_per_token or KV_BYTES_PER_TOKEN_GUESS,
                          config.n_ctx * n_workers, n_workers, (setup.kv_arena_bytes or 0) + (setup.kv_store_bytes or 0))


def placement_key(config: EngineConfig) -> str:
    where = f"gpu{config.gpu_index}:{config.n_gpu_layers}" if config.gpu_index is not None else "cpu"
    return f"{config.mode}/{where}" + (f"x{config.n_replicas}" if config.mode == "replicas" else "")


class Footprints:
    """The footprints of a service's models; ``open_store``: opens the store (None: nothing kept, the fake)."""

    def __init__(self, open_store=None, is_fake: bool = False):
        self._open_store, self.is_fake = open_store, is_fake

    async def planned(self, slot: ModelSlot) -> tuple[Footprint, object]:
        """What the load will take (measured before, else estimated), and the prepared setup (chat)."""
        if not slot.is_chat:
            size = slot.card.size_bytes or 1 << 20
            est = estimate_bytes(size, 0, 0, 0) if not self.is_fake else size
            return slot.footprint or Footprint(FootprintKey(slot.name, 0, 0, KV_TYPE, "cpu"), est,
                                               FootprintSource.ESTIMATED, est), None
        config = slot.config
        setup = await asyncio.to_thread(prepare, config, pull=False, progress=False)
        key = FootprintKey(setup.model_fingerprint, config.n_ctx, config.n_seq_max, KV_TYPE, placement_key(config))
        if config.backend == "fake":
            n = fake_footprint_bytes(config)
            return Footprint(key, n, FootprintSource.DECLARED, n, model_name=slot.name), setup
        if slot.footprint is not None and slot.footprint.key == key and \
                slot.footprint.source is FootprintSource.MEASURED:
            return slot.footprint, setup
        stored = await asyncio.to_thread(self._stored, key)
        estimate = await asyncio.to_thread(estimate_for, config, setup)
        if stored is not None:
            return dataclasses.replace(stored, estimate_bytes=estimate, model_name=slot.name), setup
        return Footprint(key, estimate, FootprintSource.ESTIMATED, estimate, model_name=slot.name), setup

    async def measured(self, slot: ModelSlot, planned: Footprint, load_s: float, kv_store_bytes: int) -> Footprint:
        """The footprint as loaded: the fake's declared one, else the workers' measured memory (the
        controller's own share left out, the KV store counted at its size, since it may fill), recorded."""
        if planned.source is FootprintSource.DECLARED:
            return dataclasses.replace(planned, load_s=load_s)
        engine = slot.engine
        memory = await asyncio.to_thread(engine.measure_memory)
        measured = footprint_of(memory, kv_store_bytes)
        footprint = Footprint(planned.key, measured, FootprintSource.MEASURED, planned.estimate_bytes, load_s,
                              planned.n_loads + 1, _now_iso(), slot.name)
        slot.measured_s = time.monotonic()
        if self._open_store is not None:
            await asyncio.to_thread(self._store_footprint, footprint, memory.to_dict())
        log.info("homepd: %s measured at %s MB (estimated %s MB)", slot.name, f"{measured / 1e6:,.0f}",
                 f"{(planned.estimate_bytes or 0) / 1e6:,.0f}")
        return footprint

    async def remeasured(self, slot: ModelSlot) -> None:
        """Measure an idle loaded model again: compute buffers grow with the largest step it ran, so the
        footprint its first load recorded (after a one-token warm-up) is raised to the largest seen."""
        engine, fp = slot.engine, slot.footprint
        if engine is None or slot.current_state() is not ModelState.LOADED:
            return
        try:
            memory = await asyncio.to_thread(engine.measure_memory)
        except Exception as exc:  # a measurement is never worth a request: keep the one we have
            log.warning("homepd: could not measure %s again: %s", slot.name, exc)
            return
        measured = footprint_of(memory, slot.kv_store_bytes)
        if measured > fp.footprint_bytes and slot.engine is engine:
            slot.footprint = dataclasses.replace(fp, footprint_bytes=measured, measured_at=_now_iso())
            log.info("homepd: %s measured at %s MB once it had run (was %s MB)", slot.name,
                     f"{measured / 1e6:,.0f}", f"{fp.footprint_bytes / 1e6:,.0f}")
            if self._open_store is not None:
                await asyncio.to_thread(self._store_footprint, slot.footprint, memory.to_dict(), False)

    def _stored(self, key: FootprintKey) -> Footprint | None:
        if self._open_store is None:
            return None
        from homepd.store.footprints import load_footprint  # why: the store (sqlite) loads only when used

        try:
            with self._open_store() as store:
                return load_footprint(store, key)
        except Exception as exc:  # a store that cannot be read never stops a load: the estimate plans it
            log.warning("homepd: could not read the footprint of %s from the store: %s", key.model_key[:12], exc)
            return None

    def _store_footprint(self, footprint: Footprint, breakdown: dict, is_load: bool = True) -> None:
        from homepd.store.footprints import record_footprint  # why: the store (sqlite) loads only when used

        try:
            with self._open_store() as store:
                record_footprint(store, footprint, breakdown, is_load)
        except Exception as exc:
            log.warning("homepd: could not record the footprint of %s: %s", footprint.model_name, exc)


def footprint_of(memory, kv_store_bytes: int) -> int:
    """A loaded model's footprint from its engine's ``MemoryBreakdown``: everything its processes hold, less
    the controller's own share (the service's, not the model's), with the KV store counted at its size (it
    fills as prefixes are saved) instead of its resident pages."""
    controller = sum(p.rest_bytes + p.weights_copied_bytes for p in memory.processes if p.role == "controller")
    return memory.total_bytes - controller - memory.kv_store_bytes + kv_store_bytes


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
