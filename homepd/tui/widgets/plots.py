"""Advise pictures in the terminal (textual-plotext): the capacity curves and the latency CDFs of one prompt
mix, and the two-box projection (projected, not measured).  Data pushed in with ``show(pictures, mix)``."""
from __future__ import annotations

import math

from rich.text import Text
from textual.widgets import Static
from textual_plotext import PlotextPlot

from homepd.advise.report.pictures import Pictures, TwinCurve, cdf
from homepd.advise.report.twobox import PROJECTED_NOTE
from homepd.tui.widgets.text import short_label

# why: plotext's named colours are the same in every theme, so a candidate keeps its colour across plots
COLORS = ("cyan", "magenta", "green", "orange", "blue", "red", "yellow", "white")
CDF_POINTS = 60     # a terminal plot has at most a few dozen columns per line


def _colors(pics: Pictures) -> dict[str, str]:
    return {name: COLORS[i % len(COLORS)] for i, name in enumerate(pics.candidates)}


class CapacityPlot(PlotextPlot):
    """Attainment against arrival rate, one line per candidate; the target share and each capacity marked.  A
    candidate with a twin is drawn as its twin: the seeds' median, their 10th and 90th percentiles dotted (the
    band), its capacity, and every check (the measured probe ``o`` above or below the twin's prediction of that
    trace ``x``)."""

    def show(self, pics: Pictures | None, mix: str) -> None:
        plt = self.plt
        plt.clear_figure()
        twins = [t for t in pics.twins if t.mix == mix and t.points] if pics else []
        twinned = {t.candidate for t in twins}
        curves = [c for c in pics.curves if c.mix == mix and c.candidate not in twinned] if pics else []
        plt.title(f"capacity · {mix} mix: share meeting every SLO vs arrival rate (req/s)")
        if not curves and not twins:
            plt.title(f"capacity · {mix} mix: no capacity search in this run")
            self.refresh()
            return
        colors = _colors(pics)
        for t in twins:
            color = colors[t.candidate]
            rates = [p[0] for p in t.points]
            plt.plot(rates, [p[1] * 100 for p in t.points], marker="braille", color=color,
                     label=twin_label(t))
            for k in (2, 3):  # the band: the seeds' p10 and p90
                plt.plot(rates, [p[k] * 100 for p in t.points], marker="dot", color=color)
            if t.capacity_rps is not None:
                plt.scatter([t.capacity_rps], [t.target_share * 100], marker="+", color=color)
            if t.checks:
                plt.scatter([c[0] for c in t.checks], [c[1] * 100 for c in t.checks], marker="o", color=color)
                plt.scatter([c[0] for c in t.checks], [c[2] * 100 for c in t.checks], marker="x", color=color)
        for c in curves:
            label = short_label(c.candidate) + ("" if c.capacity_rps is None else f" {c.capacity_rps:.2f}"
                                                + (f"±{c.spread_rps:.2f}" if c.spread_rps else ""))
            plt.plot([r for r, _ in c.points], [a * 100 for _, a in c.points], marker="braille",
                     color=colors[c.candidate], label=label)
            if c.capacity_rps is not None:
                plt.scatter([c.capacity_rps], [c.target_share * 100], marker="x", color=colors[c.candidate])
        target = (curves or twins)[0].target_share
        plt.hline(target * 100, "gray")
        plt.ylim(0, 105)
        plt.xlabel("req/s" + ("  (twin: median, dotted p10-p90; check o measured, x predicted)" if twins else ""))
        plt.ylabel(f"% (target {target:.0%})")
        self.refresh()


def twin_label(t: TwinCurve) -> str:
    """A twin's legend entry, short enough for a terminal: name, capacity [interval], the check's error."""
    head = short_label(t.candidate) + " twin"
    if t.capacity_rps is not None:
        head += f" {t.capacity_rps:.2f}"
        if t.interval_rps:
            head += f" [{t.interval_rps[0]:.2f}-{t.interval_rps[1]:.2f}]"
    if t.error_points is not None:
        head += f" ±{t.error_points:.0f}pts" + ("" if t.trusted else " untrusted")
    return head


class LatencyPlot(PlotextPlot):
    """One latency's CDF (``field``: ``ttft_ms`` or ``itl_ms``) per candidate, the budget as a vertical line."""

    def __init__(self, field: str, what: str, **kw) -> None:
        super().__init__(**kw)
        self.field, self.what = field, what

    def show(self, pics: Pictures | None, mix: str, budget_ms: float | None = None) -> None:
        plt = self.plt
        plt.clear_figure()
        lats = [x for x in pics.latencies if x.mix == mix and getattr(x, self.field)] if pics else []
        plt.title(f"{self.what} CDF · {mix} mix (ms)" if lats else f"{self.what} · {mix} mix: no latencies")
        if lats:
            # why our own log axis: plotext's log scale breaks its legend (IndexError in plotext 5.3)
            colors = _colors(pics)
            values = [v for lat in lats for v in getattr(lat, self.field) if v > 0]
            for lat in lats:
                xs, ys = cdf(tuple(v for v in getattr(lat, self.field) if v > 0), CDF_POINTS)
                plt.plot([math.log10(x) for x in xs], [y * 100 for y in ys], marker="braille",
                         color=colors[lat.candidate], label=short_label(lat.candidate))
            if budget_ms is not None:
                plt.vline(math.log10(budget_ms), "gray")
            ticks = log_ticks_ms(min(values), max(values + ([budget_ms] if budget_ms else [])))
            plt.xticks([math.log10(t) for t in ticks], [f"{t:g}" for t in ticks])
            plt.xlabel("ms (log)")
            plt.ylim(0, 100)
            plt.ylabel("%")
        self.refresh()


def log_ticks_ms(low_ms: float, high_ms: float) -> list[float]:
    """1-2-5 ticks from below ``low_ms`` to above ``high_ms`` (at most about 8)."""
    ticks = [m * 10 ** e for e in range(math.floor(math.log10(low_ms)), math.ceil(math.log10(high_ms)) + 1)
             for m in (1, 2, 5)]
    inside = [t for t in ticks if low_ms / 2 <= t <= high_ms * 2]
    return inside if len(inside) <= 8 else [t for t in inside if str(t)[0] == "1"]


def render_two_boxes(pics: Pictures | None, mix: str) -> Text:
    """The two-box rows of one mix: handoff per link and the TTFT verdict, marked projected."""
    rows = [p for p in pics.projections if p.mix == mix] if pics else []
    if not rows:
        return Text("")
    out = Text.assemble(("two boxes on paper", "bold"), (f" ({PROJECTED_NOTE})", "bold yellow"),
                        f" · {mix} mix: KV handoff over Ethernet added to each measured TTFT")
    for p in rows:
        if not p.links:
            out.append(f"\n  {short_label(p.candidate)}: {p.reason}", style="dim")
            continue
        here = "" if p.measured_handoff_ms_p50 is None else \
            f"; this box, shared memory: {_ms(p.measured_handoff_ms_p50)} ms (measured)"
        out.append(f"\n  {short_label(p.candidate)}: {p.kv_bytes_per_token / 1e3:.1f} kB/token{here}")
        for link in p.links:
            keeps = link.keeps_ttft_budget
            verdict = ("cannot judge (no interactive request)", "dim") if keeps is None else (("keeps", "green") if keeps else ("misses", "bold red"))
            out.append(f"\n    {link.link_gbit_s:g} Gbit/s: handoff p50 {link.handoff_ms_p50:.1f} ms, max "
                       f"{link.handoff_ms_max:.1f} ms; TTFT p99 {_ms(link.ttft_ms_p99)} ms → ")
            out.append(verdict[0], style=verdict[1])
            out.append(f" the {p.ttft_budget_ms:g} ms budget ({_pct(link.ttft_attainment)} within)")
    return out


class TwoBoxes(Static):
    def show(self, pics: Pictures | None, mix: str) -> None:
        text = render_two_boxes(pics, mix)
        self.display = bool(text.plain)
        self.update(text)


def _ms(x: float | None) -> str:
    return "NA" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "NA" if x is None else f"{x:.0%}"
