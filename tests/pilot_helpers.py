"""Helpers for tests that drive the app with Textual's Pilot (tests/tui and tests/integration)."""
from __future__ import annotations


async def settle(app, pilot) -> None:
    """Every worker done and every message it posted handled."""
    await app.workers.wait_for_complete()
    await pilot.pause()


async def settle_group(app, pilot, group: str) -> None:
    """The workers of ``group`` done (not the ones held at a gate) and their messages handled."""
    workers = [w for w in app.workers if w.group == group]
    if workers:  # why: wait_for_complete([]) waits for every worker
        await app.workers.wait_for_complete(workers)
    await pilot.pause()


async def type_text(pilot, text: str) -> None:
    """``text`` into the focused field at once.  A pilot key press waits for the app to idle twice (~50 ms a
    character here); typing key by key is test_tui_app's subject, not that of tests about what a turn shows."""
    from textual.widgets import Input

    field = pilot.app.focused
    assert isinstance(field, Input), field
    field.insert_text_at_cursor(text)
    await pilot.pause()
