"""The history screen: runs from the store, newest first; enter opens one with its evidence and charts."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from homepd.tui.messages import RunOpened, RunsLoaded
from homepd.tui.screens.base import StateScreen
from homepd.tui.state import AppState
from homepd.tui.widgets.evidence import EvidencePanel

COLUMNS = ("id", "kind", "started", "status", "results", "recommendation", "candidates")


class HistoryScreen(StateScreen):
    BINDINGS = [Binding("r", "reload", "reload"), Binding("enter", "open", "open run", show=True)]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("loading runs…", id="history-status")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)

    def show_state(self, state: AppState, what: str) -> None:
        if what == "all":
            self.action_reload()

    def action_reload(self) -> None:
        self.app.jobs.list_runs(self)

    def on_runs_loaded(self, message: RunsLoaded) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for r in message.rows:
            table.add_row(str(r.run_id), r.kind, r.started, r.status, str(r.n_results), r.recommendation[:48],
                          r.candidates[:40], key=str(r.run_id))
        status = self.query_one("#history-status", Static)
        if message.error:
            status.update(Text.assemble(("cannot read the run store: ", "bold red"), message.error))
        else:
            status.update(f"{len(message.rows)} run(s) · enter: open · r: reload" if message.rows
                          else "no runs recorded yet: run an advise campaign (a) first")
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self._open(event.row_key.value)

    def action_open(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            self._open(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def _open(self, key: str | None) -> None:
        if key is not None:
            self.app.push_screen(RunScreen(int(key)))


class RunScreen(Screen):
    """One stored run: its evidence table, charts and recommendation."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "back"), Binding("m", "next_mix", "next mix")]

    def __init__(self, run_id: int) -> None:
        super().__init__()
        self.run_id = run_id

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"loading run {self.run_id}…", id="run-status")
        yield EvidencePanel(id="run-evidence")
        yield Footer()

    def on_mount(self) -> None:
        self.app.jobs.open_run(self.run_id, self)

    def on_run_opened(self, message: RunOpened) -> None:
        status = self.query_one("#run-status", Static)
        if message.error:
            status.update(Text.assemble(("cannot open the run: ", "bold red"), message.error))
            return
        status.update(f"run {self.run_id} · m: charts for the next prompt mix · esc: back")
        self.query_one(EvidencePanel).show(message.view)

    def action_next_mix(self) -> None:
        self.query_one(EvidencePanel).next_mix()
