"""The help screen: what each screen shows and every key."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# homepd

**Screens** (letters work when no text field has focus; F-keys always):

| key | screen |
|---|---|
| `d` / F2 | dashboard: hardware, architecture, live charts, recent requests |
| `a` / F3 | advise: measure every architecture here and recommend one |
| `c` / F4 | chat tester |
| `h` / F5 | history of stored runs |
| `?` / F1 | this help |
| `q` / ctrl+q | quit (stops the app's own engine) |

**Advise**: `s` quick campaign, `f` full campaign, `x` cancel, `m` charts for the next prompt mix,
`w` apply the recommendation (asks first; writes the config file that `homepd serve` and the app read).

**Chat**: enter sends, ctrl+b fires a long background prompt (watch TTFT/ITL and the interference chart),
ctrl+t switches colocated / disaggregated (only when the app runs its own engine), esc leaves the text field.

**History**: enter opens a run, `r` reloads, esc goes back.

The dashboard's charts: TTFT of requests as they finish; the longest decode step (an ITL bound) or, attached
to a service, TPOT; decode tokens per second; the interference index (how much slower a decode step is when
prefill shares or runs beside it, 1.0 = none) over the last minute.  A stall is a gap between two tokens over
100 ms; the table names the prompt whose prefill held it.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
