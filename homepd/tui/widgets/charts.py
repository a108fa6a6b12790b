"""Live charts: one sparkline per series over the last minutes, titled with its last and highest value."""
from __future__ import annotations

from typing import Callable, Sequence

from textual.app import ComposeResult
from textual.containers import Grid, Vertical
from textual.widgets import Label, Sparkline

from homepd.tui.records import ChartPoint
from homepd.tui.widgets.text import num

WINDOW_POINTS = 240      # ticks on screen: two minutes at two ticks a second, newest at the right
# (id, title, value of a point, format, unit)
SERIES: tuple[tuple[str, str, Callable[[ChartPoint], float | None], str, str], ...] = (
    ("ttft", "TTFT", lambda p: p.ttft_ms, ".0f", " ms"),
    ("itl", "ITL (step) / TPOT", lambda p: p.itl_ms if p.itl_ms is not None else p.tpot_ms, ".0f", " ms"),
    ("toks", "decode tok/s", lambda p: p.tok_s, ".1f", ""),
    ("interference", "interference ×", lambda p: p.interference, ".2f", ""),
)


class LiveChart(Vertical):
    """One series over the last ``WINDOW_POINTS`` ticks; a tick without a value draws as zero, so that
    the horizontal axis stays time."""

    def __init__(self, title: str, value: Callable[[ChartPoint], float | None], spec: str, unit: str,
                 **kw) -> None:
        super().__init__(**kw)
        self.title, self.value, self.spec, self.unit = title, value, spec, unit

    def compose(self) -> ComposeResult:
        yield Label(f"{self.title}: no data yet", classes="chart-title")
        yield Sparkline([], summary_function=max)

    def show(self, points: Sequence[ChartPoint]) -> None:
        values = [self.value(p) for p in list(points)[-WINDOW_POINTS:]]
        seen = [v for v in values if v is not None]
        if seen:
            last = next(v for v in reversed(values) if v is not None)
            title = f"{self.title}: {num(last, self.spec, self.unit)}  max {num(max(seen), self.spec, self.unit)}"
        else:
            title = f"{self.title}: no data yet"
        self.query_one(Label).update(title)
        data = [0.0] * (WINDOW_POINTS - len(values)) + [0.0 if v is None else v for v in values]
        self.query_one(Sparkline).data = data


class ChartGrid(Grid):
    """The four live charts; ``show(points)`` redraws them all."""

    def compose(self) -> ComposeResult:
        for key, title, value, spec, unit in SERIES:
            yield LiveChart(title, value, spec, unit, id=f"chart-{key}")

    def show(self, points: Sequence[ChartPoint]) -> None:
        for chart in self.query(LiveChart):
            chart.show(points)
