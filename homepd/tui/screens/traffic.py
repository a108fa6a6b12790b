"""Ask how many hours of the service's recorded traffic to advise on (``advise --traffic service:Nh``)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

DEFAULT_HOURS = 24


def parse_hours(text: str) -> float | None:
    """A positive number of hours, or None."""
    try:
        hours = float(text.strip())
    except ValueError:
        return None
    return hours if 0 < hours < float("inf") else None


class TrafficHoursScreen(ModalScreen[float | None]):
    """Dismissed with the hours typed (Enter), or None (Escape)."""
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static("Advise on my last N hours of traffic: a quick campaign replaying the shape of what "
                         "homepd serve recorded (arrivals, lengths, classes, shared prefixes; no text) on every "
                         "candidate.\n\nHours (Enter runs, Escape cancels):", markup=False)
            yield Input(str(DEFAULT_HOURS), id="traffic-hours")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        hours = parse_hours(event.value)
        if hours is None:
            self.notify(f"not a number of hours > 0: {event.value!r}", severity="error")
            return
        self.dismiss(hours)

    def action_cancel(self) -> None:
        self.dismiss(None)
