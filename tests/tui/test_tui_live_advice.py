"""The dashboard's live-advice banner, driven with Pilot against the fake source: raised when the source reports
switch advice, hidden for keep, and ``e`` opens the evidence (rows, live figures, how to apply)."""
from __future__ import annotations

import pytest
from textual.widgets import Static

from homepd.advise.live.advice import AdviceKind, EvidenceRow, Verdict
from homepd.measure.profile import WindowProfile
from homepd.tui.app import HomepdApp
from homepd.tui.screens.liveadvice import AdviceScreen
from homepd.tui.sources import FakeSource

from pilot_helpers import settle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

# what the service sends (``Verdict.to_dict``), built from its own records so the fake cannot drift from it
SWITCH = Verdict(
    AdviceKind.SWITCH, "disaggregated-routed", "colocated-adaptive", "long", "the traffic looks like the long mix",
    confidence="high", margin_rps=28.0,
    evidence=(EvidenceRow(7, "disaggregated-routed", "long", 32.0, 8.0, 64.0),
              EvidenceRow(7, "colocated-adaptive", "long", 4.0, 1.0, 64.0)),
    live=WindowProfile(window_s=300.0, span_s=300.0, n_requests=40, rate_rps=2.5, rate_by_class={"interactive": 2.5},
                       prompt_tokens={"p50": 600.0, "p90": 640.0, "p99": 650.0},
                       output_tokens={"p50": 48.0, "p90": 48.0, "p99": 48.0}, mean_prompt_tokens=610.0,
                       mean_output_tokens=48.0, long_share=1.0, background_share=0.0, prefix_hit_share=0.0,
                       prefill_decode_ratio=12.7, slo_attainment={"interactive": 0.8})).to_dict()


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
