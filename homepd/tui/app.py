"""The Textual app: composes the screens, keeps the state, routes what the workers report.

One screen per task (``MODES``); every blocking call goes through ``Jobs``
(thread workers); each message that comes back updates ``AppState`` and is
handed to the screen on view, which redraws what changed.  Quitting stops the
data source (an embedded engine: its workers and shared memory) on a worker
thread, then exits.
"""
from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.worker import Worker, WorkerState

from homepd.core.modes import Mode
from homepd.tui import messages as m
from homepd.tui.jobs import Jobs
from homepd.tui.screens.advise import AdviseScreen
from homepd.tui.screens.base import StateScreen
from homepd.tui.screens.chat import ChatScreen
from homepd.tui.screens.dashboard import DashboardScreen
from homepd.tui.screens.help import HelpScreen
from homepd.tui.screens.history import HistoryScreen
from homepd.tui.sources.base import CHAT_MAX_TOKENS, DataSource
from homepd.tui.sources.chatrequest import DEMO_TOOL
from homepd.tui.state import AppState, ChatTurn
from homepd.tui.widgets.text import num

TICK_INTERVAL_S = 0.5


class HomepdApp(App):
    CSS_PATH = Path(__file__).with_name("homepd.tcss")
    TITLE = "homepd"
    ENABLE_COMMAND_PALETTE = False
    MODES = {"dashboard": DashboardScreen, "advise": AdviseScreen, "chat": ChatScreen, "history": HistoryScreen}
    DEFAULT_MODE = "dashboard"
    BINDINGS = [
        Binding("d,f2", "show('dashboard')", "dashboard"),
        Binding("a,f3", "show('advise')", "advise"),
        Binding("c,f4", "show('chat')", "chat"),
        Binding("h,f5", "show('history')", "history"),
        Binding("question_mark,f1", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("ctrl+q", "quit", "quit", show=False, priority=True),
    ]

    def __init__(self, source: DataSource, *, tick_interval_s: float | None = TICK_INTERVAL_S,
                 chat_max_tokens: int = CHAT_MAX_TOKENS):
        """``tick_interval_s``: how often the dashboard is refreshed (None: only by ``request_tick``, for tests);
        ``chat_max_tokens``: the longest chat reply."""
        super().__init__()
        self.source = source
        self.state = AppState()
        self.jobs = Jobs(self, source, chat_max_tokens)
        self.tick_interval_s = tick_interval_s
        self.is_quitting = False

    def on_mount(self) -> None:
        self.sub_title = self.state.description
        self.jobs.start()
        if self.tick_interval_s:
            self.set_interval(self.tick_interval_s, self.request_tick)

    def request_tick(self) -> None:
        if self.state.is_ready and not self.is_quitting:
            self.jobs.tick()

    def _tell(self, what: str) -> None:
        """Hand the change to the screen on view (the others redraw from the state when shown)."""
        screen = self.screen
        if isinstance(screen, StateScreen) and screen.is_mounted:
            screen.show_state(self.state, what)

    # navigation and quitting ----------------------------------------------------------------------
    def action_show(self, mode: str) -> None:
        if self.current_mode != mode:
            self.switch_mode(mode)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        if self.is_quitting:
            return
        self.is_quitting = True
        self.sub_title = "stopping…"
        self.jobs.stop()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # why here and not from the worker: the app must not exit (and cancel workers) before it has ended
        if event.worker.group == "stop" and event.state in (WorkerState.SUCCESS, WorkerState.ERROR):
            self.exit(0)

    # the source -----------------------------------------------------------------------------------
    def on_source_ready(self, message: m.SourceReady) -> None:
        s = self.state
        s.is_ready, s.error, s.description, s.can_switch_mode = True, None, message.description, message.can_switch_mode
        self.sub_title = message.description
        self._tell("source")
        self.request_tick()

    def on_source_failed(self, message: m.SourceFailed) -> None:
        self.state.error = message.error
        self.sub_title = "error (see the dashboard)"
        self._tell("source")

    def on_pull_progress(self, message: m.PullProgress) -> None:
        self.state.pull = (message.label, message.done_bytes, message.total_bytes)
        self._tell("pull")

    def on_advice_arrived(self, message: m.AdviceArrived) -> None:
        if message.view != self.state.advice:
            self.state.advice = message.view
            self._tell("advice")

    def on_tick_arrived(self, message: m.TickArrived) -> None:
        self.state.add_tick(message.tick)
        if message.tick.status and not self.state.switching:
            self.state.description = self.sub_title = message.tick.status
        self._tell("tick")

    # chat -----------------------------------------------------------------------------------------
    def send_chat(self, text: str) -> None:
        if not self.state.is_ready:
            self.notify("the engine is not ready yet", severity="warning")
            return
        history = self.state.chat_messages()
        self.state.turns.append(ChatTurn(text))
        self.jobs.chat(len(self.state.turns) - 1, history + [{"role": "user", "content": text}],
                       offer_tool=self.state.offer_tool)
        self._tell("chat")

    def on_chat_delta(self, message: m.ChatDelta) -> None:
        turn = self.state.turns[message.turn]
        for delta in message.deltas:
            turn.add(delta)
        self._tell("chat")

    def action_toggle_tool(self) -> None:
        """Offer the demo tool (get_current_time) with the next chat requests, or stop offering it."""
        self.state.offer_tool = not self.state.offer_tool
        self.notify(f"chat requests {'offer' if self.state.offer_tool else 'no longer offer'} the "
                    f"{DEMO_TOOL.name} tool")
        self._tell("chat")

    def action_next_model(self) -> None:
        """Talk to the next chat model the source serves (a service lists its models with their states)."""
        models = [row.name for row in (self.state.tick.models if self.state.tick else ()) if row.role == "chat"]
        if len(models) < 2:
            self.notify(f"one chat model here: {models[0] if models else 'not known yet'}")
            return
        current = self.source.chat_model
        name = models[(models.index(current) + 1) % len(models)] if current in models else models[1]
        self.source.pick_chat_model(name)
        self.notify(f"the chat tester talks to {name}")
        self._tell("chat")

    def on_chat_finished(self, message: m.ChatFinished) -> None:
        turn = self.state.turns[message.turn]
        turn.stats, turn.error = message.stats, message.error or (message.stats.error if message.stats else None)
        self._tell("chat")

    def action_background(self) -> None:
        if not self.state.is_ready:
            self.notify("the engine is not ready yet", severity="warning")
            return
        self.state.n_background += 1
        self.jobs.background()
        self.notify("long background prompt sent: watch TTFT/ITL and the interference chart")
        self._tell("chat")

    def on_background_finished(self, message: m.BackgroundFinished) -> None:
        self.state.n_background -= 1
        self.state.last_background = message.stats
        if message.error:
            self.notify(f"background prompt failed: {message.error}", severity="error")
        else:
            self.notify(f"background prompt done: TTFT {num(message.stats.ttft_ms)} ms, "
                        f"{message.stats.n_prompt_tokens} prompt tokens")
        self._tell("chat")

    def action_switch_mode(self) -> None:
        s = self.state
        if not s.can_switch_mode:
            self.notify("attached to a running service: its architecture is fixed", severity="warning")
            return
        if s.switching or not s.is_ready:
            return
        s.switching = True
        self.jobs.switch_mode(Mode.DISAGGREGATED if s.mode == Mode.COLOCATED else Mode.COLOCATED)
        self.notify("switching the architecture: the engine restarts (the conversation stays)")
        self._tell("chat")

    def apply_live_advice(self, candidate: str) -> None:
        """Switch to what the live advice names (the user confirmed it on the evidence screen)."""
        s = self.state
        if s.switching or not s.is_ready:
            return
        s.switching = True
        self.jobs.apply_advice(candidate)
        self.notify(f"switching to {candidate}: draining, then the workers restart")

    def on_mode_switched(self, message: m.ModeSwitched) -> None:
        self.state.switching = False
        if message.error:
            self.notify(f"could not switch to {message.mode}: {message.error}", severity="error", timeout=10)
        else:
            self.state.description = self.sub_title = message.description
            self.notify(f"now {message.mode}")
        self.request_tick()
        self._tell("chat")

    # advise ---------------------------------------------------------------------------------------
    def start_advise(self, quick: bool, traffic: str | None = None) -> None:
        s = self.state
        s.advise_running, s.advise_step, s.advise_error = True, None, None
        s.advise_candidates = {}
        self.jobs.advise(quick, traffic)
        self._tell("advise")

    def on_advise_progress(self, message: m.AdviseProgress) -> None:
        self.state.add_advise_step(message.step)
        self._tell("advise")

    def on_advise_finished(self, message: m.AdviseFinished) -> None:
        s = self.state
        s.advise_running, s.advise_error = False, message.error
        if message.view is not None:
            s.advise_view, s.advise_view_stored = message.view, False
        self.notify("advise campaign finished" if message.view else f"advise: {message.error}",
                    severity="information" if message.view else "warning")
        self._tell("advise")

    def on_applied(self, message: m.Applied) -> None:
        if message.error:
            self.notify(f"nothing written: {message.error}", severity="error", timeout=10)
        else:
            self.notify(f"wrote {message.path}; homepd serve and the app read it at start", timeout=10)

