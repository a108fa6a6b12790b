"""The dashboard's live-advice banner, driven with Pilot against the fake source: raised when the source reports
switch advice, hidden for keep, and ``e`` opens the evidence (rows, live figures, how to apply)."""
from __future__ import annotations

import pytest
from textual.widgets import Static

from homepd.tui.app import HomepdApp
from homepd.tui.screens.liveadvice import AdviceScreen
from homepd.tui.sources import FakeSource

from pilot_helpers import settle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SWITCH = {"kind": "switch", "candidate": "disaggregated-routed", "running": "colocated-adaptive", "mix": "long",
          "reason": "the traffic looks like the long mix", "confidence": "high", "margin_rps": 28.0,
          "evidence": [{"run_id": 7, "candidate": "disaggregated-routed", "mix": "long", "capacity_rps": 32.0,
                        "spread_rps": 8.0},
                       {"run_id": 7, "candidate": "colocated-adaptive", "mix": "long", "capacity_rps": 4.0,
                        "spread_rps": 1.0}],
          "live": {"rate_rps": 2.5, "window_s": 300.0, "n_requests": 40, "long_share": 1.0}, "offer": None}


async def test_switch_advice_raises_a_banner_and_e_opens_its_evidence():
    source = FakeSource()
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        banner = app.screen.query_one("#advice-banner", Static)
        assert not banner.display
        source.advice_data = SWITCH
        app.request_tick()
        await settle(app, pilot)
        assert banner.display
        text = str(banner.render())
        assert text == ("advice: disaggregated-routed would serve this traffic better than colocated-adaptive "
                        "(high confidence) — press e for the evidence")
        await pilot.press("e")
        await pilot.pause()
        assert isinstance(app.screen, AdviceScreen)
        evidence = str(app.screen.query_one("#advice-text", Static).render())
        assert "run 7 · disaggregated-routed on long: 32.00 req/s ± 8.00" in evidence
        assert "run 7 · colocated-adaptive on long: 4.00 req/s ± 1.00" in evidence
        assert "2.50 req/s over 300 s, 40 requests, long prompts 100%" in evidence
        assert "POST /advice/apply" in evidence
        await pilot.press("w")       # switch now: asks first; no changes nothing
        await pilot.pause()
        await pilot.press("n")
        await pilot.pause()
        assert source.applied_advice == [] and isinstance(app.screen, AdviceScreen)
        await pilot.press("w")
        await pilot.pause()
        await pilot.press("y")
        await settle(app, pilot)
        assert source.applied_advice == ["disaggregated-routed"] and not app.state.switching
        await pilot.press("e")
        await pilot.pause()
        assert isinstance(app.screen, AdviceScreen)
        await pilot.press("escape")
        source.advice_data = {**SWITCH, "kind": "keep", "candidate": "colocated-adaptive"}
        app.request_tick()
        await settle(app, pilot)
        assert not app.screen.query_one("#advice-banner", Static).display
