"""The app driven with Pilot against the fake data source: every screen, keys while work is in flight,
apply only after confirmation, the architecture switch, quitting stops the source."""
from __future__ import annotations

import asyncio

import pytest
from textual.widgets import DataTable, Input, ProgressBar, Static

from homepd.config import EngineConfig
from homepd.chat.reply import ToolCall
from homepd.errors import HomepdError
from homepd.tui.app import HomepdApp
from homepd.tui.messages import PullProgress
from homepd.tui.screens.advise import AdviseScreen
from homepd.tui.screens.chat import ChatScreen
from homepd.tui.screens.confirm import ConfirmScreen
from homepd.tui.screens.dashboard import DashboardScreen
from homepd.tui.screens.help import HelpScreen
from homepd.tui.screens.history import HistoryScreen, RunScreen
from homepd.tui.sources import FakeSource
from homepd.tui.widgets.architecture import ArchitecturePanel
from homepd.tui.widgets.charts import LiveChart
from homepd.tui.widgets.evidence import BarChart, EvidencePanel
from homepd.tui.widgets.hardware import HardwarePanel

from pilot_helpers import settle, settle_group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def ticks(app, pilot, n: int) -> None:
    for _ in range(n):
        app.request_tick()
        await settle(app, pilot)


async def in_flight(source: FakeSource, what: str) -> None:
    """Until the fake source waits at its gate for ``what``."""
    assert await asyncio.to_thread(source.in_flight[what].wait, 10)


def text_of(widget) -> str:
    return str(widget.render())


async def test_dashboard_shows_hardware_architecture_charts_and_requests():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await ticks(app, pilot, 3)
        screen = app.screen
        assert isinstance(screen, DashboardScreen) and app.state.is_ready
        assert "no GPU on this box" in text_of(screen.query_one(HardwarePanel))
        assert "CPU" in text_of(screen.query_one(HardwarePanel))
        arch = text_of(screen.query_one(ArchitecturePanel))
        assert "colocated · chunk 256" in arch and "[colocated]" in arch
        assert "TTFT: " in str(screen.query_one("#chart-ttft", LiveChart).query_one("Label").render())
        assert screen.query_one("#requests", DataTable).row_count == len(app.state.requests) == 4
        assert app.sub_title == "fake source: colocated, chunk 256"


async def test_dashboard_draws_prefill_kv_arena_decode_when_disaggregated():
    source = FakeSource(EngineConfig(backend="fake", mode="disaggregated"))
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        arch = text_of(app.screen.query_one(ArchitecturePanel))
        assert arch.index("[prefill]") < arch.index("KV arena") < arch.index("[decode]")
        assert "KV arena [WR··] 6.0 MiB/91 MiB" in arch and "moving 0 · 3.20 MB/s" in arch


async def test_chat_streams_replies_keeps_the_conversation_and_shows_the_figures():
    source = FakeSource()
    seen: list[list[dict]] = []
    chat = source.chat
    source.chat = lambda messages, on_delta, **kw: (seen.append(messages), chat(messages, on_delta, **kw))[1]
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        assert isinstance(app.screen, ChatScreen) and app.screen.query_one(Input).has_focus
        await pilot.press(*"hello", "enter")
        await settle(app, pilot)
        await pilot.press(*"again", "enter")
        await settle(app, pilot)
        turns = [str(s.render()) for s in app.screen.query("#chat-log Static")]
        assert len(turns) == 2
        assert "You said: hello." in turns[0] and "TTFT 120 ms (0/30 prompt tok cached) · TPOT 35.0 ms · colocated" \
            in turns[0]
        # the second turn resends the first: its reply shows the reused prefix beside its TTFT
        assert "TTFT 120 ms (30/50 prompt tok cached)" in turns[1]
        assert seen[1] == [{"role": "user", "content": "hello"},
                           {"role": "assistant", "content": "You said: hello. This is turn 1."},
                           {"role": "user", "content": "again"}]


async def test_a_reply_keeps_its_reasoning_answer_and_tool_call_apart_and_shows_each():
    source = FakeSource(thinking=True)
    seen: list[list[dict]] = []
    chat = source.chat
    source.chat = lambda messages, on_delta, **kw: (seen.append(messages), chat(messages, on_delta, **kw))[1]
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("c", "ctrl+o")                 # offer the demo tool (the text field keeps focus)
        assert app.state.offer_tool and app.screen.query_one(Input).has_focus
        assert "offering the get_current_time tool" in text_of(app.screen.query_one("#chat-status", Static))
        await pilot.press(*"what time is it?", "enter")
        await settle(app, pilot)
        turn = app.state.turns[0]
        assert turn.reasoning == "The user wrote: what time is it?\nI repeat it back."
        assert turn.reply == "You said: what time is it?. This is turn 1."
        assert list(turn.tool_calls.values()) == [ToolCall("call_fake0", "get_current_time", '{"timezone": "UTC"}')]
        shown = text_of(app.screen.query("#chat-log Static").first())
        assert shown.index("thinking") < shown.index("I repeat it back.") < shown.index("You said") \
            < shown.index('→ get_current_time({"timezone": "UTC"})') < shown.index("TTFT 120 ms")
        await pilot.press("ctrl+o")                      # off again: the next request offers nothing
        await pilot.press(*"thanks", "enter")
        await settle(app, pilot)
        assert source.offered_tool == [True, False] and app.state.turns[1].tool_calls == {}
        # the call goes back with the history, with a tool message saying it was not run
        assert [m["role"] for m in seen[1]] == ["user", "assistant", "tool", "user"]
        assert seen[1][1]["tool_calls"][0]["function"]["name"] == "get_current_time"
        assert "thinking" not in str(seen[1])            # the reasoning is not sent back


async def test_the_chat_tester_lists_the_models_and_ctrl_n_picks_the_chat_model():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        status = text_of(app.screen.query_one("#chat-status", Static))
        assert "talking to fake-chat:latest" in status and "fake-embed:latest embedding, unloaded" in status
        await pilot.press("ctrl+n")                      # the next chat model (the embedding model is skipped)
        assert "talking to fake-coder:latest" in text_of(app.screen.query_one("#chat-status", Static))
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        await pilot.press("ctrl+n")
        assert source.chat_models == ["fake-coder:latest"] and source.chat_model == "fake-chat:latest"


async def test_keys_are_handled_while_a_long_prompt_is_in_flight():
    source = FakeSource()
    source.hold("background")
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("c", "ctrl+b")
        await in_flight(source, "background")
        assert "1 background prompt(s) prefilling" in text_of(app.screen.query_one("#chat-status", Static))
        await pilot.press(*"hi", "enter")          # a chat turn while the long prompt runs
        await settle_group(app, pilot, "chat")
        await pilot.press("escape", "d")
        assert isinstance(app.screen, DashboardScreen)
        n = source.n_ticks
        app.request_tick()
        await settle_group(app, pilot, "tick")
        assert source.n_ticks == n + 1             # the dashboard kept refreshing
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "c")
        assert "You said: hi." in str(app.screen.query("#chat-log Static").last().render())
        assert app.state.n_background == 1
        source.release("background")
        await settle(app, pilot)
        assert app.state.n_background == 0 and app.state.last_background.n_prompt_tokens == 1200


async def test_keys_are_handled_while_an_advise_run_is_in_flight():
    source = FakeSource()
    source.hold("advise")
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("a", "s")
        await in_flight(source, "advise")
        await pilot.pause()
        assert app.state.advise_running
        assert "running: colocated-unchunked on the short trace" in text_of(app.screen.query_one("#advise-status"))
        await pilot.press("s")                     # a second start is refused, not queued
        await pilot.press("h")
        assert isinstance(app.screen, HistoryScreen)
        await settle_group(app, pilot, "store")
        assert app.screen.query_one("#runs", DataTable).row_count == 2   # sqlite work while advise runs
        await pilot.press("d", "a")
        source.release("advise")
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, AdviseScreen) and not app.state.advise_running
        assert app.state.advise_candidates == {"colocated-unchunked": 3, "colocated-chunk-256": 3,
                                               "disaggregated": 3}
        assert screen.query_one(ProgressBar).percentage == 1.0
        panel = screen.query_one(EvidencePanel)
        assert panel.query_one(DataTable).row_count == 9                 # 3 candidates x 3 mixes
        assert "recommended: colocated-chunk-256" in str(panel.query_one(".recommendation", Static).render())
        assert "confidence: medium" in str(panel.query_one(".recommendation", Static).render())
        assert "not measured: replicas-2" in str(panel.query_one(".evidence-notes", Static).render())
        charts = [text_of(c) for c in panel.query(BarChart)]
        assert "p99 TTFT ms · short mix" in charts[0]
        await pilot.press("m")
        assert "· long mix" in text_of(panel.query(BarChart).first())


async def test_apply_is_a_separate_action_that_asks_first():
    source = FakeSource(stored_runs=False)
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("a", "w")                 # nothing on screen yet: nothing to apply
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("s")
        await settle(app, pilot)
        await pilot.press("w")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await settle(app, pilot)
        assert source.applied == [] and isinstance(app.screen, AdviseScreen)
        await pilot.press("w", "y")
        await settle(app, pilot)
        # with the [advice] table naming the run: serve and the app then say they run its advice
        assert source.applied == [{"mode": "colocated", "chunk": 256,
                                   "advice": {"run": 7, "candidate": "colocated-chunk-256"}}]


async def test_the_chat_screen_switches_the_architecture_of_the_apps_own_engine():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("c", "ctrl+t")
        await settle(app, pilot)
        assert app.state.mode == "disaggregated" and app.sub_title == "fake source: disaggregated"
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert "disaggregated · 7 tok · KV 3.1 MiB/4.1 ms" in \
            str(app.screen.query("#chat-log Static").last().render())


async def test_history_lists_runs_and_opens_one_with_its_evidence():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("h")
        await settle(app, pilot)
        table = app.screen.query_one("#runs", DataTable)
        assert table.row_count == 2 and table.get_row_at(0)[:2] == ["7", "advise"]
        await pilot.press("down", "enter")
        await settle(app, pilot)
        assert isinstance(app.screen, RunScreen) and app.screen.run_id == 6
        assert app.screen.query_one(EvidencePanel).view.title == "advise run 6"
        await pilot.press("escape")
        assert isinstance(app.screen, HistoryScreen)


async def test_quit_stops_the_source_and_exits_zero():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("c", *"q")                # typed into the chat field: not a quit
        assert not app.is_quitting
        await pilot.press("ctrl+q")
        await settle(app, pilot)
    assert source.stopped and app.return_code == 0


class FailingSource(FakeSource):
    def start(self, emit):
        raise HomepdError("model smollm2 is not in /nowhere: run `homepd models pull smollm2`")


async def test_a_source_that_cannot_start_says_why_and_the_app_still_quits():
    source = FailingSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        notice = text_of(app.screen.query_one("#notice", Static))
        assert "error: model smollm2 is not in /nowhere" in notice
        await pilot.press("q")
        await settle(app, pilot)
    assert source.stopped and app.return_code == 0


class PullingSource(FakeSource):
    def start(self, emit):
        emit(PullProgress("extracting smollm2-135m-instruct-q4_1", 40_000_000, 100_000_000))
        self._wait("start")
        return super().start(emit)


async def test_a_model_pull_shows_a_progress_bar_until_the_engine_is_up():
    source = PullingSource()
    source.hold("start")
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await in_flight(source, "start")
        await pilot.pause()
        bar = app.screen.query_one("#pull", ProgressBar)
        assert bar.display and bar.percentage == 0.4
        assert "extracting smollm2-135m-instruct-q4_1: 38 MiB of 95 MiB" in text_of(app.screen.query_one("#notice"))
        source.release("start")
        await settle(app, pilot)
        assert not bar.display and app.state.is_ready


async def test_advise_on_my_last_n_hours_of_traffic_runs_a_campaign_on_that_window():
    from homepd.tui.screens.traffic import TrafficHoursScreen

    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("a", "t")
        await settle(app, pilot)
        assert isinstance(app.screen, TrafficHoursScreen)
        box = app.screen.query_one("#traffic-hours", Input)
        box.value = "soon"
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, TrafficHoursScreen) and source.advise_traffic == []  # refused, still asking
        box.value = "6"
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, AdviseScreen)
        assert source.advise_traffic == ["service:6h"]
        assert app.state.advise_view is not None and not app.state.advise_running
