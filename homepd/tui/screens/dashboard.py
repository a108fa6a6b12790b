"""The dashboard: hardware, architecture with its queues and KV arena, live charts, recent requests."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Header, ProgressBar, Static

from homepd.tui.screens.base import StateScreen
from homepd.tui.screens.liveadvice import AdviceScreen
from homepd.tui.state import AppState
from homepd.tui.widgets.architecture import ArchitecturePanel
from homepd.tui.widgets.charts import ChartGrid
from homepd.tui.widgets.hardware import HardwarePanel
from homepd.tui.widgets.requests import RecentRequests
from homepd.tui.widgets.text import size


class DashboardScreen(StateScreen):
    BINDINGS = [Binding("e", "evidence", "advice evidence", show=False)]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="notice")
        yield Static(id="advice-banner")
        yield ProgressBar(id="pull", show_eta=False)
        with Horizontal(id="dash-top"):
            yield HardwarePanel(id="hardware")
            yield ArchitecturePanel(id="architecture")
        yield ChartGrid(id="charts")
        yield RecentRequests(id="requests")
        yield Footer()

    def show_state(self, state: AppState, what: str) -> None:
        if what in ("pull", "source", "all"):
            self._show_notice(state)
        if what in ("advice", "all"):
            banner = self.query_one("#advice-banner", Static)
            banner.display = state.advice is not None and state.advice.has_banner
            if banner.display:
                banner.update(Text(state.advice.banner))
        if what in ("tick", "all") and state.tick is not None:
            self.query_one(HardwarePanel).show(state.tick.hardware)
            self.query_one(ArchitecturePanel).show(state.tick.architecture)
            self.query_one(ChartGrid).show(state.points)
            self.query_one(RecentRequests).show(state.requests)

    def _show_notice(self, state: AppState) -> None:
        notice, pull = self.query_one("#notice", Static), self.query_one("#pull", ProgressBar)
        pulling = state.pull is not None and not state.is_ready
        pull.display = pulling
        if pulling:
            label, done, total = state.pull
            pull.update(total=total, progress=done)
            notice.update(Text(f"{label}: {size(done)} of {size(total)} — the engine starts once the model is here"))
        elif state.error:
            notice.update(Text.assemble(("error: ", "bold red"), state.error))
        elif not state.is_ready:
            notice.update(Text(state.description))
        notice.display = pulling or bool(state.error) or not state.is_ready

    def action_evidence(self) -> None:
        advice = self.app.state.advice
        if advice is None:
            self.notify("no live advice now")
            return
        self.app.push_screen(AdviceScreen(advice))
