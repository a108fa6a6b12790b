"""The help screen: what each screen shows and every key."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]homepd[/b]: letters work when no text field has focus; F-keys always

[b]screens[/b]
  d F2  dashboard: hardware, architecture, live charts, requests
  a F3  advise: measure every architecture here, recommend one
  c F4  chat tester
  h F5  history of stored runs
  ? F1  this help
  q     quit (ctrl+q anywhere); stops the app's own engine

[b]advise[/b]
  s quick campaign   f full campaign   x cancel
  m charts for the next prompt mix
  w apply the recommendation: asks first, then writes the config
    file that `homepd serve` and the app read at start
[b]live advice[/b] a banner on the dashboard when the traffic moved
  e the evidence   w (there) switch now: asks first, drains, restarts
[b]chat[/b]
  enter send   esc leave the text field
  ctrl+b a long background prompt: watch TTFT, ITL, interference
  ctrl+t switch colocated / disaggregated (the app's own engine)
  ctrl+o offer a demo tool (get_current_time) on/off: see its calls
  ctrl+n talk to the next chat model the service serves (listed there)
[b]history[/b]
  enter open a run   r reload   esc back

[b]charts[/b] TTFT as requests finish; the longest decode step (an ITL
bound; TPOT when attached to a service); decode tok/s; interference:
how much slower a decode step is when prefill shares or runs beside
it (1.0 = none), over the last minute.
[b]stalls[/b] a gap between two tokens over 100 ms, and the prompt whose
prefill held it (same step, or beside it on the prefill worker).

esc closes this help."""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
