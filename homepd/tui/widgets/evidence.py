"""Advise evidence: the recommendation, the table (candidates × prompt mixes × metrics) and bar charts.

Used by the advise screen and by a run opened from the history screen.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, VerticalScroll
from textual.widgets import DataTable, Static

from homepd.advise.report.pictures import split_probe
from homepd.tui.records import AdviseView, EvidenceRow, RecommendationView
from homepd.tui.widgets.plots import CapacityPlot, LatencyPlot, TwoBoxes
from homepd.tui.widgets.text import bar, num, short_label

# (title, field, format)
TABLE = (("candidate", "candidate", None), ("mix", "mix", None), ("good/s", "goodput_per_s", ".2f"),
         ("SLO", "slo_attainment", ".0%"), ("TTFT p99", "ttft_ms_p99", ".0f"), ("TPOT p50", "tpot_ms_p50", ".1f"),
         ("ITL p99", "itl_ms_p99", ".0f"), ("ITL max", "itl_ms_max", ".0f"), ("out tok/s", "output_tok_s", ".1f"),
         ("interf ×", "interference", ".2f"), ("KV ms", "kv_transfer_ms", ".1f"), ("PSS MiB", "pss_mib", ".0f"))
CHARTS = (("p99 TTFT ms", "ttft_ms_p99", ".0f"), ("p99 ITL ms", "itl_ms_p99", ".0f"),
          ("goodput req/s", "goodput_per_s", ".2f"))
CONFIDENCE_STYLE = {"high": "bold green", "medium": "yellow", "low": "red"}


def render_recommendation(rec: RecommendationView | None) -> Text:
    if rec is None:
        return Text("no recommendation", style="dim")
    if rec.candidate is None:
        return Text(f"no recommendation: {rec.reason}", style="yellow")
    config = ", ".join(f"{k}={v if v is not None else 'none'}" for k, v in rec.config.items())
    text = Text.assemble(("recommended: ", "bold"), (rec.candidate, "bold green"), f"  ({config})\n",
                         ("rule: ", "bold"), rec.rule, "\n", ("why: ", "bold"), rec.reason, "\n",
                         ("confidence: ", "bold"), (rec.confidence, CONFIDENCE_STYLE.get(rec.confidence, "")),
                         f" ({rec.confidence_why})" if rec.confidence_why else "")
    if len({c for _, c in rec.per_mix}) > 1:
        text.append("\nper mix: " + ", ".join(f"{m} → {c}" for m, c in rec.per_mix), style="yellow")
    return text


def render_bars(title: str, rows: list[EvidenceRow], field: str, spec: str, width: int) -> Text:
    values = [(short_label(r.candidate), getattr(r, field)) for r in rows]
    top = max((v for _, v in values if v is not None), default=None)
    label_w = min(22, max((len(c) for c, _ in values), default=8), max(8, width // 2 - 4))
    bar_w = max(4, width - label_w - 9)
    out = Text(title, style="bold")
    for cand, v in values:
        out.append("\n")
        out.append(f"{cand[:label_w]:<{label_w}} ")
        out.append_text(bar(None if v is None or not top else v / top, bar_w, "magenta"))
        out.append(f" {num(v, spec):>7}")
    return out


class BarChart(Static):
    """Horizontal bars of one metric per candidate, for one prompt mix."""

    def __init__(self, title: str, field: str, spec: str, **kw) -> None:
        super().__init__(**kw)
        self.title, self.field, self.spec = title, field, spec
        self.rows: list[EvidenceRow] = []
        self.mix = ""

    def show(self, rows: list[EvidenceRow], mix: str) -> None:
        self.rows, self.mix = rows, mix
        self._draw()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        # why update, not render: Static sizes its auto height from the content given to update
        if not self.rows:
            self.update(Text(f"{self.title}: no data", style="dim"))
        else:
            self.update(render_bars(f"{self.title} · {self.mix} mix", self.rows, self.field, self.spec,
                                    self.content_size.width or 40))


class EvidencePanel(VerticalScroll):
    """``show(AdviseView)``; ``next_mix()`` moves the charts to the next prompt mix."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.view: AdviseView | None = None
        self.mix_index = 0

    def compose(self) -> ComposeResult:
        yield Static(classes="evidence-notes")
        yield Static(classes="recommendation")
        yield DataTable(classes="evidence-table", cursor_type="row", zebra_stripes=True)
        yield CapacityPlot(classes="capacity-plot")
        with Grid(classes="latency-plots"):
            yield LatencyPlot("ttft_ms", "TTFT", classes="ttft-plot")
            yield LatencyPlot("itl_ms", "inter-token gap", classes="itl-plot")
        yield TwoBoxes(classes="two-boxes")
        with Grid(classes="evidence-charts"):
            for title, field, spec in CHARTS:
                yield BarChart(title, field, spec)

    @property
    def mix(self) -> str:
        mixes = self.view.mixes if self.view else ()
        return mixes[self.mix_index % len(mixes)] if mixes else "-"

    def show(self, view: AdviseView | None) -> None:
        if view is not None and (self.view is None or self.view.run_id != view.run_id):
            # a new run opens on its first mix with pictures (a capacity search's probe, not its calibration)
            self.mix_index = next((i for i, m in enumerate(view.mixes) if _has_pictures(view, split_probe(m)[0])), 0)
        self.view = view
        table = self.query_one(DataTable)
        table.clear(columns=True)
        if view is None:
            self.query_one(".evidence-notes", Static).update("no evidence yet")
            self.query_one(".recommendation", Static).update("")
            for chart in self.query(BarChart):
                chart.show([], "-")
            self._show_pictures()
            return
        skipped = [f"not measured: {r.candidate}: {r.infeasible}" for r in view.rows if r.infeasible is not None]
        notes = "\n".join((view.title, *view.notes, *skipped))
        self.query_one(".evidence-notes", Static).update(Text(notes, style="dim"))
        self.query_one(".recommendation", Static).update(render_recommendation(view.recommendation))
        table.add_columns(*(title for title, _, _ in TABLE))
        for r in view.rows:
            if r.infeasible is None:
                table.add_row(*(str(getattr(r, f)) if spec is None else num(getattr(r, f), spec)
                                for _, f, spec in TABLE))
        self._show_charts()

    def next_mix(self) -> None:
        self.mix_index += 1
        self._show_charts()

    def _show_charts(self) -> None:
        rows = [r for r in (self.view.rows if self.view else ()) if r.mix == self.mix and r.infeasible is None]
        for chart in self.query(BarChart):
            chart.show(rows, self.mix)
        self._show_pictures()

    def _show_pictures(self) -> None:
        """The plots of the current mix; hidden for a view without pictures (a run from before they existed)."""
        pics = self.view.pictures if self.view else None
        # why the question's mix: a capacity search stores each probe as ``mixed@1.24/s``, and its pictures (the
        # curves, the twins' bands, the latencies at capacity) are the question's, ``mixed``
        mix = split_probe(self.mix)[0]
        capacity, latency = self.query_one(CapacityPlot), self.query_one(".latency-plots", Grid)
        capacity.display = self.view is not None and _has_pictures(self.view, mix)
        latency.display = pics is not None and any(x.mix == mix for x in pics.latencies)
        capacity.show(pics, mix)
        self.query_one(".ttft-plot", LatencyPlot).show(pics, mix, self.view.ttft_budget_ms if pics else None)
        self.query_one(".itl-plot", LatencyPlot).show(pics, mix, self.view.itl_budget_ms if pics else None)
        self.query_one(TwoBoxes).show(pics, mix)


def _has_pictures(view: AdviseView, mix: str) -> bool:
    """Whether ``view`` draws a capacity picture (a measured curve or a twin) of the question's ``mix``."""
    pics = view.pictures
    return pics is not None and any(c.mix == mix for c in (*pics.curves, *pics.twins))
