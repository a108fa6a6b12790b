"""What every main screen shares: it draws from the app's state when shown and when told of a change."""
from __future__ import annotations

from textual.screen import Screen

from homepd.tui.state import AppState


class StateScreen(Screen):
    """A screen drawn from ``AppState``: ``show_state(state, what)`` with ``what`` naming what changed
    ("tick", "pull", "chat", "advise", "source") or "all"."""

    def on_screen_resume(self) -> None:
        self.show_state(self.app.state, "all")

    def show_state(self, state: AppState, what: str) -> None:
        raise NotImplementedError
