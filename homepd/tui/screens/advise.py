"""The advise screen: run a campaign with progress per candidate, then read the evidence and the
recommendation; applying it is a separate key that asks first."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, ProgressBar, Static

from homepd.advise.campaign.budgets import FULL_WALL_BUDGET_S, QUICK_WALL_BUDGET_S, describe_budget
from homepd.config import ADVICE_TABLE
from homepd.tui.messages import RunOpened
from homepd.tui.screens.base import StateScreen
from homepd.tui.screens.confirm import ConfirmScreen
from homepd.tui.screens.traffic import TrafficHoursScreen
from homepd.tui.state import AppState
from homepd.tui.widgets.evidence import EvidencePanel

KEYS = (f"s: quick campaign (about {describe_budget(QUICK_WALL_BUDGET_S)}) · f: full campaign (about "
        f"{describe_budget(FULL_WALL_BUDGET_S)}) · t: on my last N hours of traffic")
IDLE = (f"{KEYS}. "
        "Each candidate runs on its own engines with the same short/long/mixed traces; nothing is changed "
        "until you apply (w).")


class AdviseScreen(StateScreen):
    BINDINGS = [
        Binding("s", "start(True)", "quick run"),
        Binding("f", "start(False)", "full run"),
        Binding("t", "start_traffic", "my traffic…"),
        Binding("x", "cancel", "cancel run"),
        Binding("m", "next_mix", "next mix"),
        Binding("w", "apply", "apply…"),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(IDLE, id="advise-status")
        yield ProgressBar(id="advise-progress", show_eta=False)
        yield Static(id="advise-candidates")
        yield EvidencePanel(id="advise-evidence")
        yield Footer()

    def on_mount(self) -> None:
        # why: a campaign run by the CLI (homepd advise --quick) is stored; the screen opens on the latest one
        if self.app.state.advise_view is None:
            self.app.jobs.latest_run(self)

    def on_run_opened(self, message: RunOpened) -> None:
        state = self.app.state
        if message.error:
            self.notify(f"cannot open the latest stored run: {message.error}", severity="warning")
        elif message.view is not None and state.advise_view is None and not state.advise_running:
            state.advise_view, state.advise_view_stored = message.view, True
            self.show_state(state, "advise")

    def action_start(self, quick: bool) -> None:
        if self.app.state.advise_running:
            self.notify("an advise campaign is already running", severity="warning")
            return
        self.app.start_advise(quick)

    def action_start_traffic(self) -> None:
        """Ask for N, then a quick campaign on the service's last N hours (``advise --traffic service:Nh``)."""
        if self.app.state.advise_running:
            self.notify("an advise campaign is already running", severity="warning")
            return

        def answered(hours: float | None) -> None:
            if hours is not None:
                self.app.start_advise(True, traffic=f"service:{hours:g}h")
        self.app.push_screen(TrafficHoursScreen(), answered)

    def action_cancel(self) -> None:
        if self.app.state.advise_running:
            self.app.jobs.cancel_advise()
            self.notify("cancelling the campaign…")

    def action_next_mix(self) -> None:
        self.query_one(EvidencePanel).next_mix()

    def action_apply(self) -> None:
        view = self.app.state.advise_view
        rec = view.recommendation if view else None
        if rec is None or rec.candidate is None or not rec.config:
            self.notify("no recommendation on screen to apply: run a campaign first", severity="warning")
            return
        values = ", ".join(f"{k} = {v if v is not None else 'none'}" for k, v in rec.config.items())

        def answered(yes: bool | None) -> None:
            if yes:
                # with the [advice] table: homepd serve and the app then say they run this run's advice
                self.app.jobs.apply({**rec.config, ADVICE_TABLE: {"run": view.run_id, "candidate": rec.candidate}})
        self.app.push_screen(ConfirmScreen(
            f"Write {rec.candidate} to the config file?\n\n{values}\n\n"
            "homepd serve and the app read it when they start (flags and HOMEPD_* still win)."), answered)

    def show_state(self, state: AppState, what: str) -> None:
        if what not in ("advise", "all"):
            return
        status = self.query_one("#advise-status", Static)
        progress = self.query_one("#advise-progress", ProgressBar)
        step = state.advise_step
        progress.display = state.advise_running or step is not None
        if step is not None:
            progress.update(total=max(1, step.total), progress=step.done)
        if state.advise_running:
            eta = f", about {step.eta_s:.0f} s left" if step and step.eta_s is not None else ""
            status.update(Text(f"running: {step.current if step else 'starting'}{eta}  (x cancels)"))
        elif state.advise_error:
            status.update(Text.assemble(("advise failed: ", "bold red"), state.advise_error))
        elif state.advise_view is not None and state.advise_view_stored:
            status.update(Text(f"the latest stored run ({state.advise_view.title}): its evidence is below · m: charts "
                               f"for the next prompt mix · w: apply… · {KEYS}"))
        elif state.advise_view is not None:
            status.update(Text("done: the evidence is below · m: charts for the next prompt mix · w: apply…"))
        else:
            status.update(IDLE)
        cands = Text()
        for name, done in state.advise_candidates.items():
            current = step is not None and step.candidate == name and state.advise_running
            cands.append(f"{name} {done} step(s) done" + (" ◀" if current else "") + "   ",
                         style="bold" if current else "dim")
        self.query_one("#advise-candidates", Static).update(cands)
        panel = self.query_one(EvidencePanel)
        if panel.view is not state.advise_view:
            panel.show(state.advise_view)
