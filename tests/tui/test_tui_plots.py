"""The advise screen's pictures (textual-plotext): capacity curves and latency CDFs of the current prompt mix,
and the two-box rows marked projected; hidden for a run without them.  Snapshots at 80x24 and 120x40."""
from __future__ import annotations

import dataclasses

import pytest

from homepd.config import EngineConfig
from homepd.tui.app import HomepdApp
from homepd.tui.sources import FakeSource
from homepd.tui.sources.fake import fake_advise_view, fake_pictures
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
async def test_a_twin_is_drawn_with_its_band_capacity_interval_and_checks():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        panel = await advise_done(pilot)
        await pilot.press("m", "m")
        await pilot.pause()
        assert panel.mix == "mixed"
        text = plot_text(panel.query_one(CapacityPlot))
        # the twinned candidates are drawn as their twins (not their measured curves); the rest as measured
        assert "chunk 256 twin 0.80 [0.74-0.85] ±4pts" in text and "disaggregated twin 0.50 [0.47-0.53] ±25pts untrusted" in text
        assert "chunk 256 0.65" not in text and "unchunked 0.80±0.05" in text
        assert "check o measured, x predicted" in text


@anyio
async def test_a_capacity_search_s_probe_rows_show_the_pictures_of_their_question_s_mix():
    # a stored capacity search names its rows "calibration" and "mixed@0.8/s" (one per probe), its pictures "mixed"
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        panel = await advise_done(pilot)
        stored = fake_advise_view(8)
        cand = "colocated-chunk-256"
        rows = tuple(dataclasses.replace(r, mix=m) for r, m in zip(
            [r for r in stored.rows if r.candidate == cand], ("calibration", "mixed@0.8/s", "mixed@0.4/s")))
        panel.show(dataclasses.replace(stored, rows=rows, pictures=fake_pictures()))
        await pilot.pause()
        assert panel.mix == "mixed@0.8/s"   # opens on the first mix with pictures, not the calibration
        capacity = panel.query_one(CapacityPlot)
        text = plot_text(capacity)
        assert capacity.display and "capacity · mixed mix" in text and "chunk 256 twin 0.80 [0.74-0.85]" in text
        assert "TTFT CDF · mixed mix" in plot_text(panel.query(LatencyPlot).first())
        await pilot.press("m")
        await pilot.pause()
        assert panel.mix == "mixed@0.4/s" and "chunk 256 twin 0.80" in plot_text(capacity)
        await pilot.press("m")
        await pilot.pause()
        assert panel.mix == "calibration" and not capacity.display   # a calibration has no pictures


@anyio
async def test_the_advise_screen_opens_on_the_latest_stored_run_and_states_each_campaigns_duration():
    source = FakeSource(EngineConfig(backend="fake"), pictures=True)
    app = HomepdApp(source, tick_interval_s=None)
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(pilot.app, pilot)
        await pilot.press("a")
        await settle(pilot.app, pilot)
        panel = app.screen.query_one(EvidencePanel)
        assert panel.view is not None and panel.view.title == "advise run 7" and app.state.advise_view_stored
        assert source.advise_traffic == []   # shown from the store: no campaign ran
        status = str(app.screen.query_one("#advise-status").render())
        assert "the latest stored run (advise run 7)" in status
        assert "quick campaign (about 2 min)" in status and "full campaign (about 30 min)" in status
        await pilot.press("w", "y")    # the stored run's recommendation can be applied as it stands
        await settle(pilot.app, pilot)
        assert source.applied == [{"mode": "colocated", "chunk": 256,
                                   "advice": {"run": 7, "candidate": "colocated-chunk-256"}}]
        await pilot.press("s")    # a campaign of the app's own replaces it
        await settle(pilot.app, pilot)
        assert not app.state.advise_view_stored and "done:" in str(app.screen.query_one("#advise-status").render())


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
