"""The embedded data source: an engine and a hardware sampler in this process, owned by the app.

The engine runs on a loop thread of its own (``LoopThread``); the sampler on
its thread.  ``tick`` copies what changed on the engine loop (a snapshot, the
requests finished and the steps run since the previous tick) and derives the
figures on the calling worker thread.  A missing catalog model is pulled at
start, its progress read from the partial file's size.  A chat turn is built as
``homepd serve`` builds one (the engine's ``plan_chat``, through ``chatrequest.engine_chat``: the template's
messages, the demo tool and its grammar when offered) and its text is split by
the model's chat format into reasoning, content and tool calls as it streams.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

from homepd.config import EngineConfig, request_n_ctx
from homepd.core.terms import RequestClass
from homepd.chat.reply import Delta, DeltaKind
from homepd.core.sampling import SamplingParams
from homepd.engine.controller import Engine
from homepd.engine.streams import EventKind
from homepd.engine.topology import topology_for
from homepd.errors import EngineError, PromptTooLongError
from homepd.hw.monitor import Sampler
from homepd.hw.probe import identity, probe
from homepd.launch import RestartFailed, config_origin, prepare, replace_engine
from homepd.measure.stepstream import StepSample, TokenGaps
from homepd.models.catalog import load_catalog
from homepd.models.pull import PARTIAL_PREFIX
from homepd.models.resolve import is_present, models_dir
from homepd.tui import derive
from homepd.tui.liveadvice import LocalAdvisor
from homepd.tui.records import ChatStats, ModelRow, Tick
from homepd.tui.sources.base import (BACKGROUND_MAX_TOKENS, CHAT_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P, DataSource,
                                     Emit, OnDelta, long_prompt)
from homepd.engine.chatplan import ChatPlan
from homepd.tui.sources.chatrequest import engine_chat
from homepd.tui.sources.loop import LoopThread
from homepd.tui.stepwindow import StepWindow

PULL_POLL_S = 0.25


def describe(config: EngineConfig, model_path: str, why: str = "switched in the app") -> str:
    """The app's header: the engine, the configuration it runs and why (``ConfigOrigin.why`` at start)."""
    return f"embedded engine: {topology_for(config.mode).describe(config)}, {os.path.basename(model_path)} — {why}"


def pending_pull(config: EngineConfig):
    """The catalog entry ``prepare`` will have to pull for ``config``, or None (present, a path, fake)."""
    if config.backend == "fake":
        return None
    entry = load_catalog().get(str(config.model))
    return None if entry is None or is_present(entry, models_dir(config.models_dir)) else entry


def partial_bytes(directory: Path, file_name: str) -> int:
    """Bytes assembled so far by a pull of ``file_name`` in progress in ``directory`` (this process's)."""
    total = 0
    for path in directory.glob(f"{PARTIAL_PREFIX}{os.getpid()}-{file_name}-*"):
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


class EmbeddedSource(DataSource):
    can_switch_mode = True

    def __init__(self, config: EngineConfig, *, db: str | None = None, config_file: str | None = None,
                 box=None, nvml_module=None, sample_period_s: float = 0.5):
        super().__init__(config, db=db, config_file=config_file)
        self._box, self._nvml_module, self._period_s = box, nvml_module, sample_period_s
        self.engine = None
        self.sampler = None
        self._loop: LoopThread | None = None
        self._last_t = time.monotonic()
        self._steps = StepWindow()        # the last minute of the step log: stalls, interference
        self._lock = threading.Lock()     # start vs stop: who creates and who tears down the engine
        self._closing = False
        self._started = threading.Event()
        self.description = ""
        self._advisor = None                 # live advice (homepd.tui.liveadvice), once the engine is up

    # start and stop ---------------------------------------------------------------------------
    def start(self, emit: Emit) -> str:
        if self._box is None:
            self._box = probe(self._nvml_module)
        with self._lock:
            if not self._closing:
                self.sampler = Sampler(period_s=self._period_s, nvml_module=self._nvml_module).start()
                self.sampler.register_process(os.getpid(), "app")
        setup = self._prepare(self.config, emit)
        with self._lock:  # why: stop() either sees no loop (and we bail out here) or waits for the engine
            if self._closing:
                raise EngineError("the app is quitting")
            self._loop = LoopThread()
        try:
            engine = Engine(self.config, setup, sampler=self.sampler)
            self._loop.call(engine.start())
            self.engine = engine
        finally:
            self._started.set()
        self._last_t = time.monotonic()
        self.description = describe(self.config, setup.model_path, config_origin(self.config).why)
        advisor = LocalAdvisor(self.config, self.db, box=identity(self._box))
        advisor.load()
        self._advisor = advisor
        return self.description

    def _prepare(self, config: EngineConfig, emit: Emit):
        # why: textual (the app's messages) stays out of the data source's own imports
        from homepd.tui.messages import PullProgress

        entry = pending_pull(config)
        if entry is None:
            return prepare(config, pull=False, progress=False, box=self._box)
        directory = models_dir(config.models_dir)
        with ThreadPoolExecutor(1, thread_name_prefix="homepd-pull") as pool:
            pulling = pool.submit(prepare, config, pull=True, progress=False, box=self._box)
            while True:
                done = partial_bytes(directory, entry.file_name)
                label = f"{'extracting' if done else 'downloading'} {entry.name}"
                emit(PullProgress(label, done, entry.size_bytes))
                try:
                    return pulling.result(timeout=PULL_POLL_S)
                except FutureTimeout:
                    continue

    def stop(self) -> None:
        with self._lock:
            self._closing = True
            loop = self._loop
        self.cancel_advise(wait=True)
        if loop is not None:
            self._started.wait()  # an engine starting now is stopped once it is up, never left behind
            if self.engine is not None:
                loop.call(self.engine.stop())
                self.engine = None
            loop.close()
            self._loop = None
        with self._lock:
            if self.sampler is not None:
                self.sampler.stop()
                self.sampler = None

    # the dashboard ----------------------------------------------------------------------------
    async def _collect(self, since_s: float):
        """On the engine loop: the snapshot, and what finished / ran since ``since_s``."""
        engine = self.engine
        if engine is None:
            return None, [], []
        return engine.snapshot(), engine.finished_since(since_s), engine.steps_since(since_s)

    def tick(self) -> Tick:
        now = time.monotonic()
        snap, finished, steps = (self._loop.call(self._collect(self._last_t))
                                 if self._loop is not None else (None, [], []))
        interval_s, self._last_t = max(1e-3, now - self._last_t), now
        timings = [lc.timings() for lc in finished]
        if self._advisor is not None:
            self._advisor.observe(finished)
        itl_target_ms = self.config.class_budgets[RequestClass.INTERACTIVE].itl_ms  # a gap over it is a stall
        gaps = [TokenGaps.of(lc.request_id, lc.token_times_s, itl_target_ms) for lc in finished]
        rows, point = self._steps.tick(now, interval_s, list(zip(timings, gaps)), [StepSample.of(steps, now)])
        arch = derive.architecture_view(snap, derive.kv_mb_s(timings, interval_s)) if snap else None
        hardware = derive.hardware_view(self.sampler.latest() if self.sampler else None, self._box)
        model = ModelRow(f"{self.config.model}:latest", "chat", "loaded" if snap else "loading")
        return Tick(hardware, arch, rows, point, self.description, (model,))

    def advice(self):
        return self._advisor.evaluate() if self._advisor is not None else None

    # chat -------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], on_delta: OnDelta, *, max_tokens: int = CHAT_MAX_TOKENS,
             offer_tool: bool = False) -> ChatStats:
        if self._loop is None:
            raise EngineError("the engine is not running")
        # why here, on the worker thread: the template's messages and the grammar are built off the engine loop
        request = engine_chat(getattr(self.engine, "chat_format", None), messages, offer_tool)
        return self._loop.call(self._chat(request, on_delta, max_tokens))

    async def _chat(self, request: ChatPlan, on_delta: OnDelta, max_tokens: int) -> ChatStats:
        engine = self.engine
        if engine is None:
            raise EngineError("the engine is restarting; try again in a moment")
        params = SamplingParams(max_tokens=max_tokens, grammar=request.grammar, temperature=CHAT_TEMPERATURE,
                                top_p=CHAT_TOP_P)
        extras = {} if request.chat is None else {"chat": request.chat}  # why: an engine without chat formats
        stream = await engine.submit(messages=request.messages, params=params, **extras)
        parser = request.parser()
        finish = error = None
        async for event in stream:
            if event.text:
                for delta in parser.feed(event.text) if parser else (Delta(DeltaKind.CONTENT, event.text),):
                    on_delta(delta)
            if event.kind is EventKind.DONE:
                finish = event.finish_reason
            elif event.kind is EventKind.ERROR:
                error = event.error
        for delta in parser.flush() if parser else ():
            on_delta(delta)
        return derive.chat_stats(stream.lifecycle.timings(), engine.config.mode, finish, error)

    def fit_prompt(self, n_tokens: int, seed: int) -> list[dict]:
        if self._loop is None:
            raise EngineError("the engine is not running")
        return self._loop.call(self._fit(n_tokens, seed))

    async def _fit(self, n_tokens: int, seed: int) -> list[dict]:
        """Halve the passage until the tokenized chat fits the context with room for the answer."""
        room = request_n_ctx(self.config) - BACKGROUND_MAX_TOKENS - 1
        while True:
            messages = long_prompt(n_tokens, seed)
            engine = self.engine
            try:
                if engine is None or n_tokens <= 32 or len(engine.prepare(messages=messages)) <= room:
                    return messages
            except PromptTooLongError:
                pass
            n_tokens //= 2

    # the architecture -------------------------------------------------------------------------
    def switch_mode(self, mode: str) -> str:
        if self._loop is None:
            raise EngineError("the engine is not running")
        return self._switch_to(replace(self.config, mode=mode))

    def apply_advice(self, candidate: str) -> str:
        """Restart the app's engine in the configuration live advice measured ``candidate`` with."""
        evidence = self._advisor.evidence if self._advisor is not None else None
        if evidence is None or candidate not in evidence.configs:
            raise EngineError(f"no measured candidate {candidate!r} to switch to")
        return self._switch_to(replace(self.config, **evidence.configs[candidate]))

    def _switch_to(self, config: EngineConfig) -> str:
        if self._loop is None:
            raise EngineError("the engine is not running")
        description = self._loop.call(self._switch(config))
        if self._advisor is not None:
            self._advisor.load(self.config)  # why: another configuration runs: judged afresh
        return description

    async def _switch(self, config: EngineConfig) -> str:
        new = config.validated()
        # placement first: an infeasible mode is refused while the old engine still serves
        setup = await asyncio.to_thread(prepare, new, pull=False, progress=False, box=self._box)
        old, self.engine = self.engine, None
        try:
            engine = await replace_engine(old, new, setup, lambda c, s: Engine(c, s, sampler=self.sampler))
        except RestartFailed as failed:
            self.engine = failed.restored  # None: nothing runs, and the app says why
            raise EngineError(str(failed)) from None
        self.engine, self.config = engine, new
        self._steps.clear()
        self.description = describe(new, setup.model_path)
        return self.description
