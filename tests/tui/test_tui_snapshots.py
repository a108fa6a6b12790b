"""SVG snapshots of every screen at 80x24 and 120x40, drawn from the fake source's deterministic data.

Update after an intended change with ``uv run pytest tests/tui/test_tui_snapshots.py --snapshot-update``
and look at the SVGs (tests/tui/__snapshots__/test_tui_snapshots/) before committing them.
"""
from __future__ import annotations

import pytest
from textual.widgets import DataTable, Input

from homepd.config import EngineConfig
from homepd.tui.app import HomepdApp
from homepd.tui.sources import FakeSource

from pilot_helpers import type_text

pytestmark = pytest.mark.timeout(60)
SIZES = [(80, 24), (120, 40)]
N_TICKS = 6


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


async def ready(app, pilot) -> None:
    """The source started and N_TICKS dashboard ticks taken, one after the other, then drawn.  why: a tick's
    worker ends before the next is asked for (one in flight at a time); the dashboard is drawn from the state
    its messages leave, so drawing once after the last shows what drawing after each would (0.3 s a tick)."""
    await settle(app, pilot)
    for _ in range(N_TICKS):
        app.request_tick()
        await app.workers.wait_for_complete()
    await pilot.pause()


async def quiet(app, pilot) -> None:
    """No toast and no blinking cursor in the picture, and every table's columns sized to its rows.

    # why the tables: a DataTable sizes its columns to rows added since on its own Idle event; a snapshot taken
    # before it drew the evidence table at its headers' widths ("colocated", "sho") once in four full runs"""
    app.clear_notifications()
    for field in app.screen.query(Input):
        field.cursor_blink = False
    await pilot.pause()
    for _ in range(100):
        if not any(table._require_update_dimensions for table in app.screen.query(DataTable)):
            break
        await pilot.pause()
    else:
        raise AssertionError("a table's columns were never sized to its rows")


def make_app(mode: str = "colocated", **fake) -> HomepdApp:
    return HomepdApp(FakeSource(EngineConfig(backend="fake", mode=mode), **fake), tick_interval_s=None)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_disaggregated(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app("disaggregated"), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_advise_with_evidence(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("a", "s")
        await settle(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_chat_after_two_turns(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("c")
        await type_text(pilot, "what is a KV cache?")
        await pilot.press("enter")
        await settle(pilot.app, pilot)
        await pilot.press("ctrl+t")
        await settle(pilot.app, pilot)
        await type_text(pilot, "and now?")
        await pilot.press("enter")
        await settle(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_chat_reply_with_reasoning_and_a_tool_call(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("c", "ctrl+o")
        await type_text(pilot, "what time is it?")
        await pilot.press("enter")
        await settle(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(thinking=True), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_history(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("h")
        await settle(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_history_run_opened(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("h")
        await settle(pilot.app, pilot)
        await pilot.press("enter")
        await settle(pilot.app, pilot)
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help(snap_compare, size):
    async def before(pilot):
        await ready(pilot.app, pilot)
        await pilot.press("question_mark")
        await quiet(pilot.app, pilot)
    assert snap_compare(make_app(), terminal_size=size, run_before=before)
