"""Loads and unloads a service's models under one memory budget: applies the planner's decisions.

``ensure_loaded`` is single flight: every request for a model that is not loaded waits on the one load under
way.  Before a load, the model's footprint (measured here before and kept in the store, else estimated from
its GGUF header, ``homepd.models.planner.estimate_bytes``) is planned against the budget and what is
resident (``plan_load``): it fits, or the chosen idle models are evicted first, or it waits for a busy model
to go idle (bounded by ``--load-timeout``), or it cannot fit even alone (``ModelTooLarge``: 507 with the
bytes).  One plan at a time (a lock), so two loads never count the same free bytes; the loads themselves and
every blocking call (prepare, process start, the memory measurement, sqlite) run off the event loop.
After a load the footprint is measured and recorded (``homepd.serve.footprints``); each load is logged with
its reason.  A model whose keep-alive ends with no request on it unloads.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from homepd.core.sampling import SamplingParams
from homepd.engine.embedder import ModelState
from homepd.errors import EngineError, HomepdError
from homepd.models.footprint import Footprint, FootprintSource
from homepd.models.planner import PlanKind, Resident, plan_load
from homepd.serve.footprints import Footprints
from homepd.serve.slots import KEPT_STORE_SUFFIX, LoadEvent, ModelSlot

log = logging.getLogger("homepd.serve")
MULTI_MODEL_KV_STORE_BYTES = 64 << 20   # each model's KV store when several are served and none is set
RECENT_LOADS = 32
LOAD_RETRY_S = 10.0  # after a failed load, a model's requests get that failure this long without a new try
REMEASURE_S = 30.0   # an idle loaded model is measured again at most this often


class ModelTooLarge(EngineError):
    """The model cannot fit under the memory budget even with every other model unloaded."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes


class LoadFailed(EngineError):
    """The model's load failed (its file, its workers); only its own requests see this."""


class LoadWaitTimeout(EngineError):
    """No room for the model within the load timeout: every model that would make room stayed busy."""


class Loader:
    def __init__(self, service, budget_bytes: int, store_opener=None, load_timeout_s: float = 300.0):
        self.service = service
        self.budget_bytes = budget_bytes
        self.load_timeout_s = load_timeout_s
        self.footprints = Footprints(store_opener, service.config.backend == "fake")
        self._cond = asyncio.Condition()         # one plan at a time; notified when a model goes idle or unloads
        self.recent: list[LoadEvent] = []
        self.slots: dict[str, ModelSlot] = {}

    # the plan ---------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(r.footprint_bytes for r in self._residents())

    def _residents(self, but: ModelSlot | None = None) -> list[Resident]:
        """What holds memory as the planner sees it: every resident model and each unloaded model's kept KV
        store, but ``but``'s (a load's own kept store becomes part of its footprint)."""
        out = [s.resident() for s in self.slots.values() if s is not but and s.is_resident]
        return out + [s.kept_store_resident() for s in self.slots.values() if s is not but and s.kept_store]

    async def ensure_loaded(self, slot: ModelSlot, reason: str = "request") -> float:
        """Make ``slot`` loaded (waiting on the load under way, if any); the seconds waited."""
        t0 = time.monotonic()
        while slot.current_state() is not ModelState.LOADED:
            if slot.unloading is not None:
                await asyncio.shield(slot.unloading)
                continue
            if slot.loading is None:
                failed_s = slot.failed_s
                if failed_s is not None and (ago_s := time.monotonic() - failed_s) < LOAD_RETRY_S:
                    # why: a model that cannot load (a worker that dies loading costs a process start) is not
                    # tried again by every request
                    raise LoadFailed(f"the model {slot.name} could not be loaded {ago_s:.0f} s ago: {slot.error} "
                                     f"(it is tried again {LOAD_RETRY_S:g} s after a failure)")
                slot.loading = asyncio.ensure_future(self._load(slot, reason))
                slot.loading.add_done_callback(lambda f, s=slot: setattr(s, "loading", None))
            await asyncio.shield(slot.loading)
            if not slot.is_chat:
                break  # why: the embedder's own load follows (its handle is ready); the room is made
        return time.monotonic() - t0

    async def _load(self, slot: ModelSlot, reason: str) -> None:
        t0 = time.monotonic()
        setup = None
        try:
            footprint, setup = await self.footprints.planned(slot)
            reason = await self._make_room(slot, footprint, reason)
            slot.footprint = footprint
            if not slot.is_chat:  # why: the embedder has its own lifecycle (and keep-alive); the room is made
                await slot.embedder.load()
                slot.count_load(time.monotonic() - t0)
                self._record(LoadEvent(slot.name, reason, True, slot.last_load_s, footprint.footprint_bytes, None,
                                       time.time()))
                return
            slot.begin_load()
            await self._start_engine(slot, setup)
            footprint = await self.footprints.measured(slot, footprint, time.monotonic() - t0, setup.kv_store_bytes or 0)
        except BaseException as exc:
            why = exc.args[0] if isinstance(exc, HomepdError) and exc.args else f"{type(exc).__name__}: {exc}"
            is_refusal = isinstance(exc, (ModelTooLarge, LoadWaitTimeout, asyncio.CancelledError))
            if slot.state is ModelState.LOADING or not is_refusal:
                slot.load_failed(str(why), is_failure=not is_refusal)
            self._record(LoadEvent(slot.name, reason, False, time.monotonic() - t0, None, str(why), time.time()))
            log.error("homepd: loading %s failed (%s): %s", slot.name, reason, why)
            async with self._cond:
                self._cond.notify_all()
            if is_refusal:
                raise
            raise LoadFailed(f"the model {slot.name} could not be loaded: {why}") from None
        load_s = time.monotonic() - t0
        slot.loaded(load_s, dataclasses.replace(footprint, load_s=load_s) if footprint.load_s is None else footprint)
        event = LoadEvent(slot.name, reason, True, load_s, footprint.footprint_bytes, None, time.time())
        self._record(event)
        log.info("homepd: loaded %s in %.2f s (%s; %s MB %s)", slot.name, load_s, reason,
                 f"{footprint.footprint_bytes / 1e6:,.0f}", footprint.source.value)
        self.service.publish("model", {**event.to_dict(), "state": "loaded"})

    async def _make_room(self, slot: ModelSlot, footprint: Footprint, reason: str) -> str:
        """Plan the load; evict what the plan says, or wait for room; the reason to log with the load."""
        deadline = time.monotonic() + self.load_timeout_s
        async with self._cond:
            while True:
                others = self._residents(but=slot)
                plan = plan_load(slot.name, footprint.footprint_bytes, others, self.budget_bytes, time.monotonic())
                if plan.kind is PlanKind.FITS:
                    return reason
                if plan.kind is PlanKind.TOO_LARGE:
                    raise ModelTooLarge(
                        f"the model {slot.name} needs {footprint.footprint_bytes:,} bytes "
                        f"({footprint.source.value}); the memory budget is {self.budget_bytes:,} bytes"
                        + (f", {sum(r.footprint_bytes for r in others if r.is_pinned):,} of them held by pinned "
                           "models" if any(r.is_pinned for r in others) else "")
                        + " (--memory-budget; or a smaller n_ctx for this model)",
                        footprint.footprint_bytes, self.budget_bytes)
                if plan.kind is PlanKind.EVICT:
                    line = plan.describe(slot.name)
                    log.info("homepd: %s", line)
                    for name in plan.victims:
                        if name.endswith(KEPT_STORE_SUFFIX):
                            self._drop_kept_store(self.slots[name.removesuffix(KEPT_STORE_SUFFIX)])
                        else:
                            await self._unload(self.slots[name], is_eviction=True)
                    return line.replace("evicting", "evicted", 1)
                left_s = deadline - time.monotonic()
                log.info("homepd: %s", plan.describe(slot.name))
                if left_s <= 0:
                    raise LoadWaitTimeout(f"no room for the model {slot.name} within {self.load_timeout_s:g} s: "
                                          f"{plan.describe(slot.name)}, and every model that could make room "
                                          "has requests in flight; retry later")
                try:
                    await asyncio.wait_for(self._cond.wait(), left_s)
                except asyncio.TimeoutError:
                    pass

    async def _start_engine(self, slot: ModelSlot, setup) -> None:
        service = self.service
        kept, slot.kept_store = slot.kept_store, None
        engine = service.new_engine(slot.config, setup, kept_store=kept)
        slot.engine, slot.model_path, slot.kv_store_bytes = engine, setup.model_path, setup.kv_store_bytes or 0
        try:
            await engine.start()
            if service.settings.warmup:
                stream = await engine.submit("Hello", params=SamplingParams(max_tokens=1))
                await stream.collect()
        except BaseException:
            await engine.stop()
            raise

    # unloading -------------------------------------------------------------------------------------
    async def unload(self, slot: ModelSlot, is_eviction: bool = False) -> None:
        async with self._cond:
            await self._unload(slot, is_eviction)

    async def _unload(self, slot: ModelSlot, is_eviction: bool) -> None:
        """Drain and free ``slot`` (the caller holds the plan's lock).  A model with requests is never
        chosen by a plan; one that gets a request while draining waits for the unload, then loads again."""
        if slot.current_state() is not ModelState.LOADED:
            return
        slot.begin_unload(is_eviction)
        self.service.publish("model", {"model": slot.name, "state": "draining", "eviction": is_eviction})
        slot.unloading = asyncio.get_running_loop().create_future()
        try:
            if slot.is_chat and slot.engine is not None:
                # why: its prefixes go to its KV store, kept for its next load (a return trip restores them
                # instead of prefilling again); the store counts against the budget until then
                n_saved = await slot.engine.save_prefixes()
                kept = await slot.engine.stop(keep_store=n_saved > 0)
                if kept is not None:
                    slot.kept_store = kept
                    log.info("homepd: %s's KV store kept with %d prefixes (%s MB) for its next load", slot.name,
                             n_saved, f"{slot.kept_store_bytes / 1e6:,.1f}")
            elif slot.embedder is not None:
                await slot.embedder.unload()
        finally:
            slot.unloaded()
            slot.unloading.set_result(None)
            slot.unloading = None
            self._cond.notify_all()
        log.info("homepd: unloaded %s%s", slot.name, " (evicted)" if is_eviction else "")
        self.service.publish("model", {"model": slot.name, "state": "unloaded", "eviction": is_eviction})

    def _drop_kept_store(self, slot: ModelSlot) -> None:
        log.info("homepd: %s's kept KV store dropped to make room (%s MB)", slot.name,
                 f"{slot.kept_store_bytes / 1e6:,.1f}")
        slot.kept_store.close()
        slot.kept_store = None

    def went_idle(self, slot: ModelSlot) -> None:
        """``slot`` has no request left: start its keep-alive, and wake loads waiting for room."""
        keep_s = slot.keep_alive_s
        if slot.is_chat and keep_s is not None and slot.current_state() is ModelState.LOADED and not slot.is_pinned:
            slot.cancel_expiry()
            slot.expires_at_unix_s = time.time() + keep_s
            slot.expiry = asyncio.get_running_loop().create_task(self._expire(slot, keep_s))
        loop = asyncio.get_running_loop()
        loop.create_task(self._notify())
        fp = slot.footprint
        if slot.is_chat and fp is not None and fp.source is FootprintSource.MEASURED and \
                time.monotonic() - slot.measured_s >= REMEASURE_S:
            slot.measured_s = time.monotonic()
            loop.create_task(self.footprints.remeasured(slot))

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _expire(self, slot: ModelSlot, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        if slot.n_in_flight == 0:
            slot.expiry = None
            log.info("homepd: %s's keep-alive (%g s) ended: unloading", slot.name, delay_s)
            await self.unload(slot)

    async def close(self) -> None:
        """Stop every engine (the service is stopping); a load under way is cancelled first, so that no
        worker starts after the stop."""
        loads = [s.loading for s in self.slots.values() if s.loading is not None]
        for load in loads:
            load.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        for slot in self.slots.values():
            slot.cancel_expiry()
            if slot.kept_store is not None:
                slot.kept_store.close()
                slot.kept_store = None
            if slot.is_chat and slot.engine is not None:
                await slot.engine.stop()
                slot.unloaded()

    # records -------------------------------------------------------------------------------------
    def _record(self, event: LoadEvent) -> None:
        self.recent = [*self.recent[-(RECENT_LOADS - 1):], event]
