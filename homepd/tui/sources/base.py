"""The data-source interface: where the app gets the box, the engine, chat replies, advise and history.

Every method may block (engine calls, NVML, sqlite, HTTP): the app calls them
only from Textual thread workers, never from its event loop, and sends what
they return back to the screens as messages.  Methods are thread-safe.
``emit`` posts a ``homepd.tui.messages`` message to the app from any thread.

Implementations: ``EmbeddedSource`` (an engine and a sampler in this process),
``RemoteSource`` (a ``homepd serve`` already running on this box) and
``FakeSource`` (deterministic data for tests).  Advise campaigns, the run
store and the config file are local to the box whichever source runs, so the
base class implements them once.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import threading
from typing import Callable

from homepd.advise.campaign.traffic import given_sources
from homepd.config import EngineConfig, request_n_ctx, write_config_file
from homepd.chat.reply import Delta
from homepd.errors import HomepdError
from homepd.hw.monitor import Sampler
from homepd.launch import prepare
from homepd.measure.trace import make_trace
from homepd.store import Store, default_db_path
from homepd.tui.records import AdviseView, ChatStats, RunListRow, Tick

Emit = Callable[[object], object]
OnDelta = Callable[[Delta], object]   # a piece of a reply: content, reasoning or a tool call's
CHAT_MAX_TOKENS = 256
# why: the chat tester shows what users will see, and chat clients (Open WebUI, SillyTavern, Continue) sample;
# greedily, SmolLM2 repeated one phrase thirty times in a 256-token reply
CHAT_TEMPERATURE, CHAT_TOP_P = 0.7, 0.9
BACKGROUND_MAX_TOKENS = 48
BACKGROUND_PROMPT_TOKENS = 1200   # capped at half the context
ADVISE_STOP_TIMEOUT_S = 60.0       # a cancelled campaign stops its engine within this


def long_prompt(n_tokens: int, seed: int = 0) -> list[dict]:
    """The background prompt: a passage of about ``n_tokens`` from the trace corpus to summarise (chat messages)."""
    request = make_trace("long", 1, 1.0, max_tokens=BACKGROUND_MAX_TOKENS, long_tokens=max(32, n_tokens), seed=seed)
    return [dict(m) for m in request.requests[0].messages]


class DataSource(abc.ABC):
    """What the app reads and drives; see the module docstring for the threading rules."""

    can_switch_mode = False       # True when the app owns the engine (embedded)

    def __init__(self, config: EngineConfig, *, db: str | None = None, config_file: str | None = None):
        self.config, self.db, self.config_file = config, db, config_file
        self._advise_lock = threading.Lock()
        self._advise: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
        self._advise_cancelled = False
        self._n_background = 0
        self.chat_model: str | None = None   # the model the chat tester talks to (None: the source's own)

    # the engine ------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, emit: Emit) -> str:
        """Connect or start; return a one-line description.  May emit ``PullProgress`` on the way."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what was started (an embedded engine: no process, no shared memory left).  Idempotent."""

    @abc.abstractmethod
    def tick(self) -> Tick:
        """A picture of the box and the engine now, with what finished since the previous tick."""

    def pick_chat_model(self, name: str) -> None:
        """Send the chat tester's requests to model ``name`` (one of the tick's chat models)."""
        self.chat_model = name

    def advice(self):
        """The live advice standing now (a ``homepd.tui.liveadvice.AdviceView``), None when there is none or the
        source cannot tell."""
        return None

    @abc.abstractmethod
    def chat(self, messages: list[dict], on_delta: OnDelta, *, max_tokens: int = CHAT_MAX_TOKENS,
             offer_tool: bool = False) -> ChatStats:
        """Run one chat turn, calling ``on_delta`` with each piece of the reply (``homepd.chat.format.Delta``:
        content, reasoning, a tool call's start and its arguments); return its figures.  ``offer_tool``: the
        request offers the demo tool (``chatrequest.DEMO_TOOL``), tool choice auto."""

    def background_prompt(self) -> ChatStats:
        """A long prompt that prefills while the chat runs (to feel and see the interference)."""
        self._n_background += 1
        n_tokens = min(BACKGROUND_PROMPT_TOKENS, request_n_ctx(self.config) // 2)
        return self.chat(self.fit_prompt(n_tokens, self._n_background), lambda delta: None,
                         max_tokens=BACKGROUND_MAX_TOKENS)

    def fit_prompt(self, n_tokens: int, seed: int) -> list[dict]:
        """The long prompt, sized to about ``n_tokens`` (a source that can tokenize makes sure it fits)."""
        return long_prompt(n_tokens, seed)

    def switch_mode(self, mode: str) -> str:
        """Restart the app's own engine in ``mode``; return the new description."""
        raise HomepdError("the architecture can only be switched when the app runs its own engine")

    def apply_advice(self, candidate: str) -> str:
        """Switch to the live advice's ``candidate`` (the app's engine restarts in its measured configuration,
        or the attached service drains and restarts); return what now runs."""
        raise HomepdError("this source cannot apply live advice")

    # advise, the store and the config file (local to this box) --------------------------------------
    def run_advise(self, quick: bool, emit: Emit, traffic: str | None = None) -> AdviseView:
        """Run an advise campaign here (it starts its own engines), storing its evidence; emit progress.
        ``traffic``: ``service[:SINCE]`` replays the service's recorded traffic instead of the built-in mixes."""
        # why: jinja2 (the engine) and textual (the progress message) load only when a campaign runs
        from homepd.advise.campaign.run import AdviseSettings, Campaign
        from homepd.tui.evidence import from_result, step_from_progress
        from homepd.tui.messages import AdviseProgress

        settings = AdviseSettings.quick_settings() if quick else AdviseSettings()
        base = self.config
        if traffic is not None:
            sources = given_sources(self.db, base.backend, prepare(base, pull=False, progress=False).model_path,
                                    traffic=traffic, n_ctx=base.n_ctx)
            settings = dataclasses.replace(settings, mixes=tuple(sources))
        else:
            sources = {}
        if not self._advise_lock.acquire(blocking=False):
            raise HomepdError("an advise campaign is already running")
        self._advise_cancelled = False
        loop = asyncio.new_event_loop()
        try:
            # why a sampler of its own: per-role memory peaks must not mix in this app's own workers
            with Store.open(self.db) as store, Sampler(period_s=0.5) as sampler:
                campaign = Campaign(base, settings, store=store, sampler=sampler, sources=sources,
                                    on_progress=lambda p: emit(AdviseProgress(step_from_progress(p))))
                task = loop.create_task(campaign.run())
                self._advise = (loop, task)
                if self._advise_cancelled:  # cancelled while the store and sampler were opening
                    task.cancel()
                result = loop.run_until_complete(task)
            return from_result(result)
        finally:
            self._advise = None
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            self._advise_lock.release()

    def cancel_advise(self, wait: bool = False) -> None:
        """Cancel a running campaign (its engines stop; the run is kept as incomplete); with ``wait``,
        return once it has ended."""
        self._advise_cancelled = True
        running = self._advise
        if running is not None:
            loop, task = running
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile: nothing left to cancel
                pass
        if wait and self._advise_lock.acquire(timeout=ADVISE_STOP_TIMEOUT_S):
            self._advise_lock.release()

    def list_runs(self, limit: int = 50) -> list[RunListRow]:
        """The newest runs of the store (none when there is no database yet)."""
        path = self.db or default_db_path()
        if str(path) != ":memory:" and not os.path.exists(path):
            return []
        with Store.open(path, create=False) as store:
            runs = store.list_runs(limit)
        # why indexing: list_runs gives every row each of these keys (a column may be NULL)
        return [RunListRow(r["id"], r["kind"], r["status"], (r["started_at"] or "")[:19].replace("T", " "),
                           r["n_results"], ", ".join(r["candidates"]) or "-", r["recommendation"] or "-")
                for r in runs]

    def open_run(self, run_id: int) -> AdviseView:
        """One stored run as an advise view (evidence, recommendation)."""
        # why: jinja2 (the engine, via the advise report) loads only when a run is opened
        from homepd.tui.evidence import from_stored_run

        with Store.open(self.db, create=False) as store:
            return from_stored_run(store.load_run(run_id))  # with timelines: the gap CDF needs every token

    def latest_run(self, limit: int = 20) -> AdviseView | None:
        """The newest stored advise run that reached a recommendation (among the newest ``limit`` runs), as a
        view: what the advise screen opens on.  None: none stored yet."""
        for row in self.list_runs(limit):
            if row.kind == "advise" and row.recommendation != "-":
                return self.open_run(row.run_id)
        return None

    def apply(self, values: dict) -> str:
        """Write a recommended configuration to the config file; return where it went."""
        return str(write_config_file(values, self.config_file))
