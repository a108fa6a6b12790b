"""The advise screen's pictures (textual-plotext): capacity curves and latency CDFs of the current prompt mix,
and the two-box rows marked projected; hidden for a run without them.  Snapshots at 80x24 and 120x40."""
from __future__ import annotations

import pytest

from homepd.config import EngineConfig
from homepd.tui.app import HomepdApp
from homepd.tui.sources import FakeSource
from homepd.tui.widgets.evidence import EvidencePanel
from homepd.tui.widgets.plots import CapacityPlot, LatencyPlot, TwoBoxes
from pilot_helpers import settle

pytestmark = pytest.mark.timeout(60)
anyio = pytest.mark.anyio
SIZES = [(80, 24), (120, 40)]


def make_app(pictures: bool = True) -> HomepdApp:
    return HomepdApp(FakeSource(EngineConfig(backend="fake"), pictures=pictures), tick_interval_s=None)


async def advise_done(pilot) -> EvidencePanel:
    await settle(pilot.app, pilot)
    await pilot.press("a", "s")
    await settle(pilot.app, pilot)
    pilot.app.clear_notifications()
    await pilot.pause()
    return pilot.app.screen.query_one(EvidencePanel)


def plot_text(plot) -> str:
    return plot.render().plain


@anyio
async def test_the_plots_show_the_current_mix_and_follow_the_mix_key():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        panel = await advise_done(pilot)
        capacity = panel.query_one(CapacityPlot)
        assert capacity.display and panel.mix == "short"
        text = plot_text(capacity)
        assert "capacity · short mix" in text and "unchunked 0.60±0.05" in text and "disaggregated 0.30±0.05" in text
        ttft, itl = panel.query(LatencyPlot)
        assert "TTFT CDF · short mix" in plot_text(ttft) and "inter-token gap CDF · short mix" in plot_text(itl)
        boxes = panel.query_one(TwoBoxes)
        assert "projected, not measured" in str(boxes.render()) and "10 Gbit/s" in str(boxes.render())
        await pilot.press("m")
        await pilot.pause()
        assert panel.mix == "long" and "capacity · long mix" in plot_text(capacity)
        assert "chunk 256 0.55±0.05" in plot_text(capacity)


@anyio
async def test_a_run_without_pictures_shows_no_plot():
    app = make_app(pictures=False)
    async with app.run_test(size=(120, 40)) as pilot:
        panel = await advise_done(pilot)
        assert not panel.query_one(CapacityPlot).display
        assert not panel.query_one(".latency-plots").display and not panel.query_one(TwoBoxes).display


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_advise_pictures(snap_compare, size):
    async def before(pilot):
        panel = await advise_done(pilot)
        panel.scroll_to_widget(panel.query_one(CapacityPlot), animate=False, top=True)
        await pilot.pause()
    assert snap_compare(make_app(), terminal_size=size, run_before=before)
