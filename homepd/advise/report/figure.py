"""The advise pictures as an image file (SVG, and PNG): the one module that imports matplotlib.

One row per prompt mix: the capacity curves (attainment against arrival rate, one line per candidate, the
target share as a horizontal line, each capacity marked with its spread; a candidate with a twin: the twin's
curve with its seeds' band, its capacity's interval, and each measured check beside the twin's prediction of
that trace, the error in points written by it), then the TTFT and the inter-token
gap distributions (CDFs, one line per candidate, the budgets as vertical lines); below them, the two-box
projection as text, marked projected.  Drawn on a ``matplotlib.figure.Figure`` with the Agg canvas: no
pyplot, no global state, safe from the app's worker thread.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, PercentFormatter, ScalarFormatter

from homepd.advise.report.pictures import Pictures, cdf
from homepd.advise.report.twobox import render_projection

# why: text stays text in the SVG (searchable, smaller, and the tests can find the series names)
SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "homepd"}
ROW_HEIGHT_IN = 3.6
WIDTH_IN = 16.0
DPI = 100


def draw(pics: Pictures, *, ttft_budget_ms: float | None = None, itl_budget_ms: float | None = None) -> Figure:
    """The figure of ``pics`` (not yet written)."""
    mixes = pics.mixes or ("-",)
    projection = render_projection(list(pics.projections))
    text_lines = projection.count("\n") + 1 if projection else 0
    text_in = 0.17 * text_lines + (0.3 if projection else 0)
    fig = Figure(figsize=(WIDTH_IN, ROW_HEIGHT_IN * len(mixes) + 0.6 + text_in), dpi=DPI)
    FigureCanvasAgg(fig)
    fig.suptitle(pics.title, fontsize=13)
    top = 1 - 0.6 / fig.get_figheight()
    bottom = (text_in + 0.1) / fig.get_figheight() if projection else 0.05
    grid = fig.add_gridspec(len(mixes), 3, top=top - 0.02, bottom=bottom + 0.5 / fig.get_figheight(),
                            hspace=0.55, wspace=0.28)
    colors = {name: f"C{i % 10}" for i, name in enumerate(pics.candidates)}
    for row, mix in enumerate(mixes):
        _capacity(fig.add_subplot(grid[row, 0]), pics, mix, colors)
        _distribution(fig.add_subplot(grid[row, 1]), pics, mix, colors, "ttft_ms", "TTFT", ttft_budget_ms)
        _distribution(fig.add_subplot(grid[row, 2]), pics, mix, colors, "itl_ms", "inter-token gap", itl_budget_ms)
    if projection:
        fig.text(0.01, bottom - 0.02, projection, family="monospace", fontsize=7.5, va="top", ha="left")
    return fig


def write(pics: Pictures, stem: Path, *, png: bool = True, ttft_budget_ms: float | None = None,
          itl_budget_ms: float | None = None) -> list[Path]:
    """Write ``stem``.svg (and ``stem``.png); return the paths written.  Each file appears whole or not at all."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(SVG_RC):
        fig = draw(pics, ttft_budget_ms=ttft_budget_ms, itl_budget_ms=itl_budget_ms)
        paths = []
        for suffix in (".svg", ".png") if png else (".svg",):
            path = stem.with_name(stem.name + suffix)
            tmp = path.with_name(path.name + ".tmp")
            fig.savefig(tmp, format=suffix[1:], metadata=_metadata(suffix))
            tmp.replace(path)
            paths.append(path)
    return paths


def _metadata(suffix: str) -> dict:
    # why: no creation date, so the same run draws the same file
    return {"Date": None} if suffix == ".svg" else {"Software": "homepd"}


def _capacity(ax, pics: Pictures, mix: str, colors: dict) -> None:
    curves = [c for c in pics.curves if c.mix == mix]
    twins = {t.candidate: t for t in pics.twins if t.mix == mix}
    ax.set_title(f"capacity · {mix} mix", fontsize=10)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("requests meeting every SLO")
    ax.set_ylim(-0.02, 1.05)
    if not curves and not twins:
        ax.text(0.5, 0.5, "no capacity search in this run", ha="center", va="center", transform=ax.transAxes,
                color="gray")
        return
    for curve in curves:
        if curve.candidate in twins:
            continue  # its probes are the twin's checks, drawn with it
        rates = [r for r, _ in curve.points]
        shares = [a for _, a in curve.points]
        line, = ax.plot(rates, shares, marker="o", markersize=3, color=colors[curve.candidate],
                        label=_capacity_label(curve))
        line.set_gid(f"capacity:{curve.candidate}:{mix}")
        if curve.capacity_rps is not None:
            ax.errorbar([curve.capacity_rps], [curve.target_share], xerr=[curve.spread_rps or 0.0], fmt="*",
                        markersize=11, color=colors[curve.candidate], capsize=3)
    for twin in twins.values():
        _twin(ax, twin, colors[twin.candidate], mix)
    target = (curves[0] if curves else next(iter(twins.values()))).target_share
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:.0%}")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    if twins:
        ax.plot([], [], "D", color="gray", markersize=6, label="measured check")
        ax.plot([], [], "x", color="gray", markersize=7, label="twin, same trace")
    ax.legend(fontsize=7, loc="lower left")


def _twin(ax, twin, color: str, mix: str) -> None:
    """A twin's curve (median of its seeds, the 10-90 % band), its capacity with its interval (shaded), and each
    check: the measured attainment (a diamond) and the twin's prediction of the same trace (a cross), joined."""
    if twin.points:
        rates = [p[0] for p in twin.points]
        line, = ax.plot(rates, [p[1] for p in twin.points], color=color, linewidth=1.4, marker=".",
                        label=twin.label())
        line.set_gid(f"twin:{twin.candidate}:{mix}")
        band = ax.fill_between(rates, [p[2] for p in twin.points], [p[3] for p in twin.points], color=color,
                               alpha=0.15, linewidth=0)
        band.set_gid(f"twin-band:{twin.candidate}:{mix}")
    if twin.capacity_rps is not None:
        low, high = twin.interval_rps or (twin.capacity_rps, twin.capacity_rps)
        span = ax.axvspan(low, high, color=color, alpha=0.12, linewidth=0)
        span.set_gid(f"twin-interval:{twin.candidate}:{mix}")
        ax.errorbar([twin.capacity_rps], [twin.target_share],
                    xerr=[[twin.capacity_rps - low], [high - twin.capacity_rps]], fmt="*", markersize=11,
                    color=color, capsize=3)
    for rate, measured, predicted in twin.checks:
        ax.plot([rate, rate], [measured, predicted], color=color, linewidth=0.8, linestyle=":")
        dot, = ax.plot([rate], [measured], "D", color=color, markersize=6, markeredgecolor="black",
                       markeredgewidth=0.6)
        dot.set_gid(f"check:{twin.candidate}:{mix}")
        ax.plot([rate], [predicted], "x", color=color, markersize=7)
        ax.annotate(f"{(predicted - measured) * 100:+.0f} pts", (rate, min(measured, predicted)), fontsize=7,
                    color=color, textcoords="offset points", xytext=(4, -10))


def _capacity_label(curve) -> str:
    if curve.capacity_rps is None:
        return f"{curve.candidate}: no capacity found"
    spread = f" ± {curve.spread_rps:.2f}" if curve.spread_rps else ""
    return f"{curve.candidate}: {curve.capacity_rps:.2f}{spread} req/s"


def _distribution(ax, pics: Pictures, mix: str, colors: dict, field: str, what: str,
                  budget_ms: float | None) -> None:
    ax.set_title(f"{what} · {mix} mix (CDF)", fontsize=10)
    ax.set_xlabel(f"{what} (ms, log scale)")
    ax.set_ylabel("share of " + ("requests" if field == "ttft_ms" else "gaps"))
    drawn = False
    for lat in (x for x in pics.latencies if x.mix == mix):
        xs, ys = cdf(tuple(v for v in getattr(lat, field) if v > 0))
        if not xs:
            continue
        # why the leading 0: the staircase starts on the axis, not at the first value's 1/n
        line, = ax.step([xs[0], *xs], [0.0, *ys], where="post", color=colors[lat.candidate], label=lat.candidate)
        line.set_gid(f"{field}:{lat.candidate}:{mix}")
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no latencies recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    ax.set_xscale("log")
    # why: plain numbers (20, 100, 1000) read better than 10^x, and minor-tick labels overlap
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    if budget_ms is not None:
        ax.axvline(budget_ms, color="black", linestyle="--", linewidth=0.8, label=f"budget {budget_ms:g} ms")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower right")
