"""The messages that carry data from workers (and data sources) to the app and its screens.

Each carries a frozen record from ``homepd.tui.records`` (or plain values);
posting one is thread-safe, so a data source may post from any thread.
"""
from __future__ import annotations

from textual.message import Message

from homepd.chat.reply import Delta
from homepd.tui.liveadvice import AdviceView
from homepd.tui.records import AdviseStep, AdviseView, ChatStats, Tick


class SourceReady(Message):
    """The data source is up: ``description`` says what it is (embedded engine, remote service)."""

    def __init__(self, description: str, can_switch_mode: bool) -> None:
        super().__init__()
        self.description, self.can_switch_mode = description, can_switch_mode


class SourceFailed(Message):
    """The data source could not start (or stopped working): ``error`` says why."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class PullProgress(Message):
    """A model download: bytes so far of ``total_bytes`` (None: not known yet)."""

    def __init__(self, label: str, done_bytes: int, total_bytes: int | None) -> None:
        super().__init__()
        self.label, self.done_bytes, self.total_bytes = label, done_bytes, total_bytes


class TickArrived(Message):
    """A new picture of the box and the engine (about twice a second)."""

    def __init__(self, tick: Tick) -> None:
        super().__init__()
        self.tick = tick


class ChatDelta(Message):
    """The pieces of a reply streamed since the previous message (at most one every ~50 ms), in order, each
    saying which part it belongs to (``Delta.kind``: content, reasoning, a tool call's start or arguments)."""

    def __init__(self, turn: int, deltas: tuple[Delta, ...]) -> None:
        super().__init__()
        self.turn, self.deltas = turn, deltas


class ChatFinished(Message):
    """A chat reply ended; ``stats`` go under it (None when it failed: ``error``)."""

    def __init__(self, turn: int, stats: ChatStats | None, error: str | None = None) -> None:
        super().__init__()
        self.turn, self.stats, self.error = turn, stats, error


class BackgroundFinished(Message):
    """The long background prompt ended (or failed: ``error``)."""

    def __init__(self, stats: ChatStats | None, error: str | None = None) -> None:
        super().__init__()
        self.stats, self.error = stats, error


class ModeSwitched(Message):
    """The app's own engine now runs ``mode`` (or failed to switch: ``error``)."""

    def __init__(self, mode: str, error: str | None = None, description: str = "") -> None:
        super().__init__()
        self.mode, self.error, self.description = mode, error, description


class AdviseProgress(Message):
    def __init__(self, step: AdviseStep) -> None:
        super().__init__()
        self.step = step


class AdviseFinished(Message):
    """An advise campaign ended with ``view``, or failed with ``error``."""

    def __init__(self, view: AdviseView | None, error: str | None = None) -> None:
        super().__init__()
        self.view, self.error = view, error


class RunsLoaded(Message):
    """The history list (or why it could not be read)."""

    def __init__(self, rows: list, error: str | None = None) -> None:
        super().__init__()
        self.rows, self.error = rows, error


class RunOpened(Message):
    """A stored run, ready to show (or why it could not be read)."""

    def __init__(self, view: AdviseView | None, error: str | None = None) -> None:
        super().__init__()
        self.view, self.error = view, error


class Applied(Message):
    """The recommended configuration was written to ``path`` (or not: ``error``)."""

    def __init__(self, path: str | None, error: str | None = None) -> None:
        super().__init__()
        self.path, self.error = path, error


class AdviceArrived(Message):
    """The live advice standing now (None: none), read with each tick."""

    def __init__(self, view: AdviceView | None) -> None:
        super().__init__()
        self.view = view
