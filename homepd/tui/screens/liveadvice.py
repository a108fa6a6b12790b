"""The evidence behind the dashboard's advice banner: the verdict, the evidence rows, the live figures."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from homepd.tui.liveadvice import AdviceView
from homepd.tui.screens.confirm import ConfirmScreen


def evidence_text(view: AdviceView) -> Text:
    text = Text.assemble((f"advice: {view.kind}", "bold"), f"  ({view.confidence} confidence)\n\n", view.reason,
                         "\n\n", ("evidence\n", "bold"))
    for line in view.evidence or ("no evidence rows",):
        text.append(f"  {line}\n")
    text.append("\n")
    text.append("live traffic\n", "bold")
    text.append(f"  {view.live}" + (f" · matched mix {view.mix}" if view.mix else "") + "\n")
    if view.margin_rps is not None:
        text.append(f"  margin {view.margin_rps:+.2f} req/s\n")
    if view.offer:
        text.append(f"\nto measure it: {view.offer}\n")
    if view.kind == "switch":
        text.append("\nw: switch now (asks first; it drains, restarts the workers and resumes; POST /advice/apply "
                    "on the service),\nor `homepd advise apply --candidate " + str(view.candidate) + "` for the next start\n")
    text.append("\nesc closes this")
    return text


class AdviceScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,e", "app.pop_screen", "close"), Binding("w", "switch", "switch now…")]

    def __init__(self, view: AdviceView):
        super().__init__()
        self.view = view

    def action_switch(self) -> None:
        if self.view.kind != "switch" or not self.view.candidate:
            self.notify("this advice names nothing to switch to", severity="warning")
            return
        candidate = self.view.candidate

        def answered(yes: bool | None) -> None:
            if yes:
                self.app.pop_screen()
                self.app.apply_live_advice(candidate)
        self.app.push_screen(ConfirmScreen(f"Switch to {candidate}? Running requests finish, new ones wait, the "
                                           "workers restart in its measured configuration. (y/n)"), answered)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="advice-evidence"):
            yield Static(evidence_text(self.view), id="advice-text")
