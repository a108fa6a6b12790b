"""Live charts: one sparkline per series over the last minutes, titled with its last and highest value."""
from __future__ import annotations

from typing import Callable, Sequence

from textual.app import ComposeResult
from textual.containers import Grid, Vertical
from textual.widgets import Label, Sparkline

from homepd.tui.records import ChartPoint
from homepd.tui.widgets.text import num

# (id, title, value of a point, format, unit, None counts as zero)
SERIES: tuple[tuple[str, str, Callable[[ChartPoint], float | None], str, str, bool], ...] = (
    ("ttft", "TTFT", lambda p: p.ttft_ms, ".0f", " ms", False),
    ("itl", "ITL (step) / TPOT", lambda p: p.itl_ms if p.itl_ms is not None else p.tpot_ms, ".0f", " ms", False),
    ("toks", "decode tok/s", lambda p: p.tok_s, ".1f", "", True),
    ("interference", "interference ×", lambda p: p.interference, ".2f", "", False),
)


class LiveChart(Vertical):
    def __init__(self, title: str, value: Callable[[ChartPoint], float | None], spec: str, unit: str,
                 zero_for_none: bool, **kw) -> None:
        super().__init__(**kw)
        self.title, self.value, self.spec, self.unit, self.zero_for_none = title, value, spec, unit, zero_for_none

    def compose(self) -> ComposeResult:
        yield Label(f"{self.title}: no data yet", classes="chart-title")
        yield Sparkline([], summary_function=max)

    def show(self, points: Sequence[ChartPoint]) -> None:
        values = [self.value(p) for p in points]
        data = [0.0 if v is None else v for v in values] if self.zero_for_none else [v for v in values if v is not None]
        last = next((v for v in reversed(values) if v is not None), None)
        title = f"{self.title}: {num(last, self.spec, self.unit)}"
        if data:
            title += f"  max {num(max(data), self.spec, self.unit)}"
        self.query_one(Label).update(title if data else f"{self.title}: no data yet")
        self.query_one(Sparkline).data = data


class ChartGrid(Grid):
    """The four live charts; ``show(points)`` redraws them all."""

    def compose(self) -> ComposeResult:
        for key, title, value, spec, unit, zero in SERIES:
            yield LiveChart(title, value, spec, unit, zero, id=f"chart-{key}")

    def show(self, points: Sequence[ChartPoint]) -> None:
        for chart in self.query(LiveChart):
            chart.show(points)
