"""The service around one engine: start-up and readiness, bounded admission, drain, watchdog.

Lives on the asyncio loop that uvicorn runs, which is also the engine's loop:
the engine's pipes, the HTTP handlers and the systemd watchdog ping share it,
so a loop that hangs stops the pings and systemd restarts the service.
States: starting -> ready -> draining -> stopped; ``failed`` when the engine
cannot start or a worker fails for good (the process then exits 1, and
``Restart=on-failure`` starts it afresh).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass

from homepd.config import EngineConfig
from homepd.config.models import ModelSpec, served_models
from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle
from homepd.config.origin import ConfigOrigin
from homepd.core.protocol import StepRecord
from homepd.engine.controller import Engine
from homepd.engine.topology import topology_for
from homepd.launch import config_origin
from homepd.measure.steplog import StepLog
from homepd.measure.stepstream import StepSample, StepSampler, TokenGaps
from homepd.measure.trace.traffic import Route
from homepd.serve.advice import AdviceCollector, LiveAdvisor
from homepd.serve.errors import APIError, unavailable
from homepd.serve.generation import DEFAULTS
from homepd.serve.metrics import ServiceMetrics
from homepd.serve.registry import ModelRegistry
from homepd.serve.budget import UNBOUNDED_BYTES, memory_budget_bytes
from homepd.serve.settings import ServeSettings
from homepd.serve.switch import SwitchError, switch_to
from homepd.serve.systemd import Notifier
from homepd.serve.traffic import TrafficCollector, TrafficRecorder, prompt_text

log = logging.getLogger("homepd.serve")
WATCH_PERIOD_S = 1.0         # how often the engine's health is checked (and the watchdog pinged, at the latest)
RECENT_REQUESTS = 50         # finished requests kept for /status
SUBSCRIBER_QUEUE = 1000      # events buffered per /events client; a slower client misses events, and is told
# a request arriving during a restart waits when the restart should be back within this share of its TTFT
# budget (the rest is for its own prefill)
RESTART_WAIT_SHARE = 0.5
MAX_IGNORED_NAMES = 64      # unknown field names counted under their own label (a client cannot grow /metrics)
SWITCH_START_S = 120.0       # a request that waits for a switch waits the drain and this long for the new engine


@dataclass
class _Subscriber:
    """One /events client: its step sampler, and the events it missed since the last one it was sent."""
    sampler: StepSampler
    n_missed: int = 0


class Service:
    def __init__(self, config: EngineConfig, settings: ServeSettings, *, notifier: Notifier | None = None,
                 sampler=None, origin: ConfigOrigin | None = None, models: tuple[ModelSpec, ...] | None = None):
        """``models``: every model served (``homepd.config.models.served_models``); default: ``config.model``
        and ``--embedding-model``."""
        self.config, self.settings = config, settings
        # which configuration it serves with and why (applied advice, the built-in default, flags)
        self.origin = origin if origin is not None else config_origin(config)
        self.notifier = notifier or Notifier()
        self.sampler = sampler
        self.state = "starting"
        self.failure: str | None = None
        self.exit_code = 0
        self.started_s, self.started_wall_s = time.monotonic(), time.time()
        self.served_model_ids: tuple[str, ...] = tuple(dict.fromkeys((config.model, *settings.served_model_names)))
        self._ignored_seen: set[str] = set()  # field names logged once and counted under their own label
        if models is None:
            models = served_models((config.model,), {}, keep_alive_s=settings.keep_alive_s,
                                   embedding_model=settings.embedding_model)
        # the models by name and role, each loaded on demand under the memory budget
        is_multi = sum(m.role == "chat" for m in models) > 1
        # why unbounded for one model without --memory-budget: that service loads its model as it always did
        budget = memory_budget_bytes(settings) if is_multi or settings.memory_budget_bytes else UNBOUNDED_BYTES
        self.models = ModelRegistry(self, models, budget, self._open_store)
        self.config = self.models.default.config  # the default model's engine settings (its table's, if any)
        self.metrics = ServiceMetrics(self)
        self.in_flight: dict[str, str] = {}           # request id -> request class, admitted and not finished
        self.recent: deque[dict] = deque(maxlen=RECENT_REQUESTS)
        # each /events client's queue of events, and its sample of the steps run since its last steps event
        self._subscribers: dict[asyncio.Queue, _Subscriber] = {}
        self.n_events_missed = 0  # events not delivered to an /events client that read too slowly
        self._idle = asyncio.Event()
        self._idle.set()
        self._exiting = asyncio.Event()
        self.admitting = asyncio.Event()             # clear while the configuration is switched (homepd.serve.switch)
        self.admitting.set()
        self._tasks: set[asyncio.Task] = set()
        self.on_exit = lambda: None                   # set by the server: make uvicorn exit
        self.traffic: TrafficRecorder | None = None   # the traffic recording (off with --no-record-traffic)
        if settings.record_traffic:
            # why: sqlite_utils (the store) loads only when traffic is recorded
            from homepd.store import Store

            self.traffic = TrafficRecorder(lambda: Store.open(settings.db), record_text=settings.record_text,
                                           max_rows=settings.traffic_retention_rows,
                                           max_age_days=settings.traffic_retention_days)
            self.metrics.registry.register(TrafficCollector(self.traffic))
        # every engine step as a JSON line (--step-log), opened before anything loads: a bad path is said at once
        self.step_log = StepLog(settings.step_log) if settings.step_log else None
        self.advisor = None                           # live advice (off with --no-advice)
        if settings.advice:
            self.advisor = LiveAdvisor(self)
            self.metrics.registry.register(AdviceCollector(self.advisor))

    def _open_store(self):
        # why: sqlite_utils (the store) loads only when a footprint is read or recorded
        from homepd.store import Store

        return Store.open(self.settings.db)

    def _default_engine(self):
        return self.models.default_engine

    def _set_default_engine(self, engine) -> None:
        self.models.default.engine = engine

    # the default chat model's engine (the first configured), None while it is not loaded
    engine = property(_default_engine, _set_default_engine)

    def check_open(self) -> None:
        """Refuse (503) a request while the service drains, has failed or stopped, before it waits for a model."""
        if self.state in ("draining", "failed", "stopped"):
            code, message = self.unavailable_reason() or ("draining", "homepd is shutting down")
            self.metrics.rejected.labels(code).inc()
            raise unavailable(message, code, retry_after_s=30)

    # start-up ----------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm the default model (the HTTP port is already open: /ready says 503 meanwhile)."""
        self._spawn(self.models.refresh())  # why first: model listings answer while the engine loads
        if self.traffic is not None:
            self.traffic.start()
        if self.advisor is not None:  # why: before any request ends, so the restored traffic is all from before
            await asyncio.to_thread(self.advisor.load)
        try:
            self.notifier.status(f"loading {self.config.model}")
            if self.sampler is not None:
                self.sampler.register_process(os.getpid(), "controller")
            await self.models.loader.ensure_loaded(self.models.default, "start")
            model_file = os.path.basename(self.models.default.model_path)
            self.served_model_ids = tuple(dict.fromkeys((self.config.model, os.path.splitext(model_file)[0],
                                                         *self.settings.served_model_names)))
            if self.sampler is not None:  # why: so /metrics has every process's memory from its first scrape once
                await asyncio.to_thread(self.sampler.sample_once)  # ready (the sampler's thread may not have run yet)
        except Exception as exc:
            self._fail(f"the engine could not start: {exc}")
            return
        self.state = "ready"
        self.notifier.ready(self._status_line())
        log.info("homepd: ready (%s, %s): %s", self.config.mode, self.served_model_ids[0], self.origin.line)
        self._spawn(self._watch())
        if self.advisor is not None:
            self._spawn(self.advisor.run())

    async def stop(self) -> None:
        if not self.admitting.is_set():  # why: a switch under way would start an engine after this stop
            try:
                await asyncio.wait_for(self.admitting.wait(), SWITCH_START_S)
            except asyncio.TimeoutError:
                pass
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.models.close()
        if self.traffic is not None:
            await asyncio.to_thread(self.traffic.stop)
        if self.advisor is not None:
            self.advisor.close()  # its twin's child process, its model vocabulary
        if self.step_log is not None:
            self.step_log.close()
        if self.state != "failed":
            self.state = "stopped"

    def _fail(self, reason: str) -> None:
        log.error("homepd: %s", reason)
        self.state, self.failure, self.exit_code = "failed", reason, 1
        self.notifier.status(f"failed: {reason}")
        self.request_exit()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Ping the systemd watchdog from this loop; leave (exit 1) when a worker failed for good."""
        period_s = min(WATCH_PERIOD_S, self.notifier.watchdog_interval_s or WATCH_PERIOD_S)
        while True:
            self.notifier.watchdog()
            if self.models.is_multi:
                await self._unload_failed_models()
                await asyncio.sleep(period_s)
                continue
            failed = self._failed_workers()
            if failed and self.state == "ready":
                self.state = "failed"
                reasons = "; ".join(self.engine.health().reasons)
                self.failure = f"the {failed} could not be restarted" + (f" ({reasons})" if reasons else "")
                log.error("homepd: %s; exiting so that the service manager starts homepd afresh", self.failure)
                self.exit_code = 1
                self._spawn(self.drain(0.0))
            await asyncio.sleep(period_s)

    async def _unload_failed_models(self) -> None:
        """Several models: one whose workers failed for good is unloaded with the reason (its requests have
        failed); the others keep serving, and its next request loads it afresh."""
        for slot in list(self.models.slots.values()):
            engine = slot.engine
            if slot.is_chat and engine is not None and slot.state.value == "loaded" and engine.health().failed:
                reasons = "; ".join(engine.health().reasons)
                log.error("homepd: %s's workers failed (%s): unloading it", slot.name, reasons or "no reason given")
                await self.models.loader.unload(slot)
                slot.error = f"its workers failed ({reasons})" if reasons else "its workers failed"

    # admission ---------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        if self.models.is_multi:  # why: the default model may be evicted; the others load on demand
            return self.state == "ready"
        return self.state == "ready" and self.unavailable_reason() is None

    def model_capacity(self, config: EngineConfig) -> int:
        """Requests one model admits at once: every entry worker's sequences plus the wait queue."""
        return topology_for(config.mode).capacity(config, self.settings.max_queue)

    @property
    def capacity(self) -> int:
        """Requests admitted at once: each chat model's capacity, summed."""
        return sum(self.model_capacity(s.config) for s in self.models.slots.values() if s.is_chat)

    def _failed_workers(self, engine=None) -> str | None:
        engine = engine if engine is not None else self.engine
        failed = engine.health().failed if engine is not None else ()
        return ", ".join(failed) + " worker" + ("s" if len(failed) > 1 else "") if failed else None

    def unavailable_reason(self, engine=None) -> tuple[str, str] | None:
        """(code, message) when no request can be admitted now (to ``engine``: default, the default
        model's), else None."""
        engine = engine if engine is not None else self.engine
        if self.state == "starting":
            return "not_ready", "the model is still loading; retry shortly"
        if self.state == "draining":
            return "draining", "homepd is shutting down and admits no new request"
        if self.state == "switching":
            return "switching", "homepd is switching to another configuration; retry in a moment"
        if self.state in ("failed", "stopped") or self._failed_workers(engine):
            return "engine_failed", f"the engine has failed ({self.failure or self._failed_workers(engine)})"
        if engine is not None and engine.health().restarting:
            return "worker_restarting", "a worker died and is being restarted; retry in a moment"
        return None

    def admit(self, request_id: str, request_class: RequestClass, engine=None) -> None:
        """Reserve a place for a request (on ``engine``: default, the default model's), or raise a 503
        APIError (with Retry-After) saying why not."""
        if self.advisor is not None:  # why before the checks: a request refused for a full queue is demand too
            self.advisor.arrived(request_class)
        engine = engine if engine is not None else self.engine
        reason = self.unavailable_reason(engine)
        retry_s = None
        if reason is not None and reason[0] == "worker_restarting":
            reason, retry_s = self._through_restart(request_class, engine)
        if reason is None and len(self.in_flight) >= self.capacity:
            reason = ("queue_full", f"{len(self.in_flight)} requests are running or waiting (the most is "
                                    f"{self.capacity}); retry later")
        if reason is not None:
            self.metrics.rejected.labels(reason[0]).inc()
            retry_s = retry_s or {"not_ready": 5, "draining": 30, "engine_failed": 30}.get(reason[0], 1)
            raise unavailable(reason[1], reason[0], retry_after_s=retry_s)
        self.in_flight[request_id] = request_class
        self._idle.clear()

    def _through_restart(self, request_class: RequestClass, engine) -> tuple[tuple[str, str] | None, int | None]:
        """A request arriving while a worker restarts waits for it (the engine holds it in that worker's
        backlog) when the restart is expected back within its share of the class's TTFT budget; otherwise it is
        refused with the expected wait as Retry-After.  Both are counted (``homepd_restart_arrivals_total``)."""
        budget_s = self.config.class_budgets[request_class].ttft_ms / 1e3
        eta_s = engine.restart_eta_s()
        if eta_s is not None and eta_s <= RESTART_WAIT_SHARE * budget_s:
            self.metrics.restart_arrivals.labels("waited").inc()
            return None, None
        self.metrics.restart_arrivals.labels("refused").inc()
        why = "not known" if eta_s is None else f"{eta_s:.1f} s"
        return ("worker_restarting", f"a worker died and is being restarted (expected back in {why}, past this "
                                     f"{request_class} request's {budget_s:g} s TTFT budget); retry then"), \
            max(1, math.ceil(eta_s)) if eta_s is not None else 1

    def ignored_fields(self, names: list[str]) -> list[str]:
        """The unknown fields of a request: a 400 with ``--strict-fields``, else counted, logged once per name,
        and returned for the response's ``homepd.ignored_fields``."""
        if names and self.settings.strict_fields:
            raise APIError(400, f"{', '.join(names[:5])}: unsupported field (homepd does not implement it; remove "
                                "it, or run without --strict-fields)", code="unsupported_field", param=names[0])
        for name in names:
            name = name[:64]
            if name not in self._ignored_seen and len(self._ignored_seen) < MAX_IGNORED_NAMES:
                self._ignored_seen.add(name)
                log.info("homepd: ignoring request field %r (not implemented; listed in homepd.ignored_fields)", name)
            self.metrics.ignored_fields.labels(name if name in self._ignored_seen else "other").inc()
        return names

    def note_arrival(self, stream, route: Route, max_tokens: int, prompt: str | None, messages: list | None) -> None:
        """A request reached the engine: its shape goes to the traffic recording (when on)."""
        if self.traffic is not None:
            arrived_unix_s = time.time() - (time.monotonic() - stream.lifecycle.arrived_s)
            self.traffic.arrived(stream.request_id, stream.prompt_ids, arrived_unix_s, route,
                                 stream.lifecycle.request_class, max_tokens,
                                 prompt_text(prompt, messages) if self.traffic.record_text else None)

    def finished(self, request_id: str, lc: Lifecycle | None, request_class: RequestClass) -> None:
        """A request admitted with ``admit`` is over: free its place, count it, tell the /events clients."""
        self.models.request_done(request_id)
        if self.in_flight.pop(request_id, None) is None:
            return
        if not self.in_flight:
            self._idle.set()
        if lc is None:
            return
        met = self.advisor.observe(lc) if self.advisor is not None else None
        if self.traffic is not None:
            self.traffic.ended(request_id, lc, met)
        self.metrics.observe_finished(lc)
        itl_target_ms = self.config.class_budgets[RequestClass.INTERACTIVE].itl_ms  # a gap over it is a stall
        record = {**lc.to_dict(), "request_class": request_class.value,
                  **TokenGaps.of(lc.request_id, lc.token_times_s, itl_target_ms).to_dict()}
        self.recent.append(record)
        self.publish("request", record)
        self.notifier.status(self._status_line())

    def spawn_finish(self, stream, request_class: RequestClass) -> None:
        """``finished`` once ``stream`` (cancelled, its client gone) has received its last event."""
        async def wait_end() -> None:
            async for _ in stream:
                pass
            self.finished(stream.request_id, stream.lifecycle, request_class)

        self._spawn(wait_end())

    def new_engine(self, config: EngineConfig, setup, kept_store=None):
        """The service's engine for ``config`` (not started): its sampler, and its steps feeding ``/events``;
        ``kept_store``: the KV store its model's previous engine kept (``homepd.serve.loader``)."""
        engine = Engine(config, setup, sampler=self.sampler, kept_store=kept_store)
        engine.step_listeners.append(self._on_step)
        if self.step_log is not None:
            engine.step_listeners.append(lambda step, model=config.model: self.step_log.write(model, step))
        return engine

    async def until_admitting(self) -> None:
        """Wait while a switch of configuration is under way (then admission decides as usual)."""
        if not self.admitting.is_set():
            try:
                await asyncio.wait_for(self.admitting.wait(), self.settings.drain_timeout_s + SWITCH_START_S)
            except asyncio.TimeoutError:
                pass

    @property
    def idle(self) -> asyncio.Event:
        """Set while no admitted request is unfinished."""
        return self._idle

    def spawn_switch(self, candidate: str, why: str) -> None:
        """Switch to ``candidate`` in the background (``--auto-apply``); a switch that cannot be done is logged."""
        async def switch() -> None:
            try:
                await switch_to(self, candidate, why)
            except SwitchError as exc:
                log.warning("homepd: no switch to %s: %s", candidate, exc)

        self._spawn(switch())

    # drain ---------------------------------------------------------------------------
    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop admitting, let running requests finish for ``timeout_s`` (default: the setting), abort the
        rest, then make the server exit."""
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        if self.state not in ("failed",):
            self.state = "draining"
        self.notifier.stopping(f"draining {len(self.in_flight)} requests (up to {timeout_s:.0f} s)")
        log.info("homepd: draining %d requests (up to %.0f s)", len(self.in_flight), timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("homepd: drain timeout: aborting %d requests", len(self.in_flight))
            for rid in list(self.in_flight):
                if self.engine is not None:
                    self.engine.cancel(rid)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        self.request_exit()

    def request_exit(self) -> None:
        """End the /events streams and make the server exit (the engine stops in the lifespan's end)."""
        self._exiting.set()
        self.on_exit()

    # state for /status and /events -----------------------------------------------------------
    def status(self) -> dict:
        engine = self.engine
        return {
            "state": self.state, "ready": self.is_ready, "failure": self.failure,
            "uptime_s": time.monotonic() - self.started_s, "models": list(self.served_model_ids),
            "sampling_defaults": DEFAULTS.to_dict(),
            "configuration": self.origin.to_dict(),
            "admission": {"in_flight": len(self.in_flight), "capacity": self.capacity,
                          "restart_eta_s": engine.restart_eta_s() if engine is not None and
                          engine.tokenizer is not None else 0.0,
                          "max_queue": self.settings.max_queue,
                          "by_class": {c: list(self.in_flight.values()).count(c) for c in set(self.in_flight.values())}},
            "engine": engine.snapshot().to_dict() if engine is not None and engine.tokenizer is not None else None,
            "recent_requests": list(self.recent),
            "traffic": self.traffic.status() if self.traffic is not None else {"recording": False},
            "served_models": [{**slot.to_dict(), "name": slot.card.name, "state": self.models.state(slot.card).value,
                               "expires_at": self.models.expires_at(slot.card).isoformat()}
                              for slot in self.models.slots.values()],
            "memory": {k: v for k, v in self.models.status().items() if k != "models"},
        }

    async def next_event(self, queue: asyncio.Queue, timeout_s: float) -> tuple[str, dict] | None:
        """The next (kind, data) published to ``queue``; None after ``timeout_s`` or when the service exits."""
        getter, exiting = asyncio.ensure_future(queue.get()), asyncio.ensure_future(self._exiting.wait())
        done, pending = await asyncio.wait({getter, exiting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return getter.result() if getter in done else None

    @property
    def is_exiting(self) -> bool:
        return self._exiting.is_set()

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self._subscribers[queue] = _Subscriber(StepSampler())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.pop(queue, None)

    def _on_step(self, step: StepRecord) -> None:
        # why a bounded sampler per client, not its queue: a step costs O(1) per client whatever the step rate,
        # and a client that reads slowly holds at most its sampler's bound, never a growing backlog
        for sub in self._subscribers.values():
            sub.sampler.add(step)

    def drain_steps(self, queue: asyncio.Queue) -> StepSample:
        """The steps run since this client's previous call, sampled (at most ``stepstream.MAX_STEPS``)."""
        sub = self._subscribers.get(queue)
        return sub.sampler.drain(time.monotonic()) if sub is not None else StepSample.of((), time.monotonic())

    def publish(self, kind: str, data: dict) -> None:
        """Queue an event for every /events client.  A client whose queue is full misses it; the next event it
        gets is a ``missed`` event with the count, so it knows its record has a hole (counted in /metrics)."""
        for queue, sub in self._subscribers.items():
            if sub.n_missed and queue.maxsize - queue.qsize() >= 2:
                queue.put_nowait(("missed", {"events": sub.n_missed}))
                sub.n_missed = 0
            if sub.n_missed or queue.full():
                sub.n_missed += 1
                self.n_events_missed += 1
            else:
                queue.put_nowait((kind, data))

    def _status_line(self) -> str:
        return (f"{self.state}: {self.config.mode} on {self.served_model_ids[0]}, "
                f"{len(self.in_flight)} requests in flight")
