"""Every blocking call the app makes, each in a Textual thread worker that reports back with a message.

The app's event loop never waits on the data source: ``Jobs`` starts a worker
per call and the worker posts the outcome (``homepd.tui.messages``) to the
app, or to the screen that asked.  Chat pieces are coalesced (one message every
``CHAT_FLUSH_S`` at most, each run of one part joined) and dashboard ticks never
overlap (a tick still running when the next is due is skipped).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial
from typing import Callable

from textual.message_pump import MessagePump

from homepd.chat.reply import Delta, DeltaKind
from homepd.errors import HomepdError
from homepd.tui import messages as m
from homepd.tui.sources.base import CHAT_MAX_TOKENS, DataSource

CHAT_FLUSH_S = 0.05


def coalesce(deltas: list[Delta]) -> tuple[Delta, ...]:
    """The pieces in order, each run of the same part (of the same call) joined into one."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and delta.kind is last.kind and delta.index == last.index \
                and delta.kind is not DeltaKind.TOOL_CALL_START:
            out[-1] = replace(last, text=last.text + delta.text)
        else:
            out.append(delta)
    return tuple(out)


def error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, HomepdError) else f"{type(exc).__name__}: {exc}"


class Jobs:
    def __init__(self, app, source: DataSource, chat_max_tokens: int = CHAT_MAX_TOKENS):
        self.app, self.source, self.chat_max_tokens = app, source, chat_max_tokens
        self._ticking = threading.Lock()

    def _run(self, fn: Callable[[], None], group: str) -> None:
        self.app.run_worker(fn, thread=True, group=group, exit_on_error=False)

    def _post(self, message, target: MessagePump | None = None) -> None:
        (target or self.app).post_message(message)

    # the source ---------------------------------------------------------------------------------
    def start(self) -> None:
        def work() -> None:
            try:
                description = self.source.start(self._post)
            except Exception as exc:  # shown on screen; the app keeps running so the user can read it
                self._post(m.SourceFailed(error_text(exc)))
            else:
                self._post(m.SourceReady(description, self.source.can_switch_mode))
        self._run(work, "source")

    def tick(self) -> None:
        if not self._ticking.acquire(blocking=False):
            return  # the previous tick is still being taken: skip this one

        def work() -> None:
            try:
                tick = self.source.tick()
            except Exception as exc:
                self._post(m.SourceFailed(error_text(exc)))
            else:
                self._post(m.TickArrived(tick))
                try:
                    self._post(m.AdviceArrived(self.source.advice()))
                except Exception:  # why: advice is a hint; a source that cannot give it keeps ticking
                    pass
            finally:
                self._ticking.release()
        self._run(work, "tick")

    def stop(self) -> None:
        """Stop the source on a worker thread (the app exits when that worker has ended)."""
        self._run(self.source.stop, "stop")

    # chat ---------------------------------------------------------------------------------------
    def chat(self, turn: int, messages: list[dict], offer_tool: bool = False) -> None:
        def work() -> None:
            pending: list[Delta] = []
            last = [time.monotonic()]

            def on_delta(delta: Delta) -> None:
                pending.append(delta)
                now = time.monotonic()
                if now - last[0] >= CHAT_FLUSH_S:
                    last[0] = now
                    self._post(m.ChatDelta(turn, coalesce(pending)))
                    pending.clear()
            try:
                stats = self.source.chat(messages, on_delta, max_tokens=self.chat_max_tokens, offer_tool=offer_tool)
            except Exception as exc:
                stats, error = None, error_text(exc)
            else:
                error = None
            if pending:
                self._post(m.ChatDelta(turn, coalesce(pending)))
            self._post(m.ChatFinished(turn, stats) if stats else m.ChatFinished(turn, None, error))
        self._run(work, "chat")

    def background(self) -> None:
        def work() -> None:
            try:
                self._post(m.BackgroundFinished(self.source.background_prompt()))
            except Exception as exc:
                self._post(m.BackgroundFinished(None, error_text(exc)))
        self._run(work, "background")

    def switch_mode(self, mode: str) -> None:
        def work() -> None:
            try:
                description = self.source.switch_mode(mode)
            except Exception as exc:
                self._post(m.ModeSwitched(mode, error_text(exc)))
            else:
                self._post(m.ModeSwitched(mode, description=description))
        self._run(work, "switch")

    def apply_advice(self, candidate: str) -> None:
        def work() -> None:
            try:
                description = self.source.apply_advice(candidate)
            except Exception as exc:
                self._post(m.ModeSwitched(candidate, error_text(exc)))
            else:
                self._post(m.ModeSwitched(candidate, description=description))
        self._run(work, "switch")

    # advise, history, apply ---------------------------------------------------------------------
    def advise(self, quick: bool, traffic: str | None = None) -> None:
        def work() -> None:
            try:
                view = self.source.run_advise(quick, self._post, traffic=traffic)
            except BaseException as exc:  # CancelledError included: the user cancelled it
                self._post(m.AdviseFinished(None, "cancelled" if type(exc).__name__ == "CancelledError"
                                            else error_text(exc)))
            else:
                self._post(m.AdviseFinished(view))
        self._run(work, "advise")

    def cancel_advise(self) -> None:
        self._run(self.source.cancel_advise, "advise-cancel")

    def list_runs(self, target: MessagePump) -> None:
        self._call(partial(self.source.list_runs), lambda rows: m.RunsLoaded(rows),
                   lambda e: m.RunsLoaded([], e), target)

    def open_run(self, run_id: int, target: MessagePump) -> None:
        self._call(partial(self.source.open_run, run_id), lambda view: m.RunOpened(view),
                   lambda e: m.RunOpened(None, e), target)

    def latest_run(self, target: MessagePump) -> None:
        """The newest stored advise run with a recommendation, as ``RunOpened`` (its view None: none stored)."""
        self._call(self.source.latest_run, lambda view: m.RunOpened(view), lambda e: m.RunOpened(None, e), target)

    def apply(self, values: dict, target: MessagePump | None = None) -> None:
        self._call(partial(self.source.apply, values), lambda path: m.Applied(path),
                   lambda e: m.Applied(None, e), target)

    def _call(self, fn, ok, failed, target: MessagePump | None) -> None:
        def work() -> None:
            try:
                result = fn()
            except Exception as exc:
                self._post(failed(error_text(exc)), target)
            else:
                self._post(ok(result), target)
        self._run(work, "store")
