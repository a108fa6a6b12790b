"""What the advise pictures draw, read from a live result or a stored run: capacity curves, latency
distributions and the two-box projection.

Both shapes end up as plain request dicts (``Lifecycle.to_dict()`` plus ``token_times_s``, as the store keeps
them), so one code path serves the app, the image file and ``homepd history show --plot``.  Capacity curves
are read from the plain ``CapacityCurve`` dicts (``to_plain``) wherever the evidence carries them under a
``"capacity"`` key; a run without them (older runs) draws no curve.  Pure: no plotting library, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from homepd.advise.report.twobox import HandoffSample, TwoBoxProjection, project
from homepd.config import EngineConfig
from homepd.core.admission import RequestClass
from homepd.core.records import to_plain
from homepd.core.modes import Mode
from homepd.core.stats import percentile

RECOVERY_MARK = "+kill"     # the recovery scenario's runs (candidate and mix carry it): not a latency picture
PROBE_MARK = "@"            # a stored capacity probe's mix: "mixed@0.5/s"


@dataclass(frozen=True)
class CapacityCurve:
    """Attainment against arrival rate for one candidate on one mix (from the capacity search's plain dict)."""
    candidate: str
    mix: str
    target_share: float
    points: tuple[tuple[float, float], ...]     # (rate req/s, attainment 0..1), by rate
    capacity_rps: float | None
    spread_rps: float | None
    decided_by: str


@dataclass(frozen=True)
class Latencies:
    """One candidate's measured latencies on one mix, every repeat pooled (ms); with a capacity search, those
    of the probe at its capacity (what the evidence table shows)."""
    candidate: str
    mix: str
    ttft_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]       # every gap between two tokens


@dataclass(frozen=True)
class Pictures:
    """Everything the pictures draw for one advise run."""
    title: str
    curves: tuple[CapacityCurve, ...]
    latencies: tuple[Latencies, ...]
    projections: tuple[TwoBoxProjection, ...]

    @property
    def mixes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*(c.mix for c in self.curves), *(lat.mix for lat in self.latencies)]))

    @property
    def candidates(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*(c.candidate for c in self.curves), *(lat.candidate for lat in self.latencies)]))


@dataclass(frozen=True)
class RunData:
    """One measured run (a candidate, a mix, a repeat) as plain request dicts."""
    candidate: str
    mode: Mode | None
    mix: str
    requests: tuple[dict, ...]


# ---- reading --------------------------------------------------------------------------------

def read_curve(data) -> CapacityCurve | None:
    """A ``CapacityCurve`` plain dict -> ``CapacityCurve``; None when ``data`` does not have its shape."""
    if not isinstance(data, dict) or not isinstance(data.get("probes"), (list, tuple)):
        return None
    try:
        at: dict[float, list[float]] = {}
        for p in data["probes"]:
            if isinstance(p, dict) and p.get("rate_rps") is not None and p.get("attainment") is not None:
                at.setdefault(round(float(p["rate_rps"]), 9), []).append(float(p["attainment"]))
        # why the mean: the repeats probe some rates on two seeds; one point per rate keeps the curve a curve
        points = sorted((rate, sum(a) / len(a)) for rate, a in at.items())
        return CapacityCurve(
            candidate=str(data["candidate"]), mix=str(data["mix"]), target_share=float(data.get("target_share", 0.9)),
            points=tuple(points), capacity_rps=_float_or_none(data.get("capacity_rps")),
            spread_rps=_float_or_none(data.get("spread_rps")), decided_by=str(data.get("decided_by") or ""))
    except (KeyError, TypeError, ValueError):
        return None


def find_curves(obj) -> tuple[CapacityCurve, ...]:
    """Every capacity curve under a ``"capacity"`` key anywhere in ``obj`` (the JSON result, a stored run),
    first occurrence of each candidate x mix kept."""
    found: dict[tuple[str, str], CapacityCurve] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            held = node.get("capacity")
            # why both: an evidence row holds one curve, the stored recommendation a list of them
            for curve in map(read_curve, held if isinstance(held, list) else [held]):
                if curve is not None:
                    found.setdefault((curve.candidate, curve.mix), curve)
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(obj)
    return tuple(found.values())


def runs_from_result(result) -> list[RunData]:
    """The measured runs of a live ``homepd.advise.campaign.run.AdviseResult``."""
    modes = {c.name: c.mode for c in result.candidates}
    return [RunData(cand, modes.get(cand), mix, tuple({**lc.to_dict(), "token_times_s": list(lc.token_times_s)}
                                                      for lc in record.requests))
            for (cand, mix, _), record in result.records.items()]


def split_probe(mix: str) -> tuple[str, float | None]:
    """A stored probe's mix ``"mixed@0.5/s"`` -> ``("mixed", 0.5)``; any other mix -> ``(mix, None)``."""
    base, sep, rate = mix.partition(PROBE_MARK)
    try:
        return (base, float(rate.removesuffix("/s"))) if sep else (mix, None)
    except ValueError:
        return mix, None


def at_capacity(runs: list[RunData], curves: tuple[CapacityCurve, ...]) -> list[RunData]:
    """The stored probes of each candidate x mix reduced to the one at its capacity (as the live result keeps
    them: where no probe passed, its lowest), renamed to the plain mix; other runs as they are."""
    capacity = {(c.candidate, c.mix): c.capacity_rps for c in curves}
    probes: dict[tuple[str, str], list[tuple[float, RunData]]] = {}
    out = []
    for run in runs:
        base, rate = split_probe(run.mix)
        if rate is None:
            out.append(run)
        else:
            probes.setdefault((run.candidate, base), []).append((rate, run))
    for (cand, base), rated in probes.items():
        target = capacity.get((cand, base))
        target = min(r for r, _ in rated) if target is None else target
        # why the nearest: the stored name rounds the rate to 3 significant digits
        best = min(abs(r - target) for r, _ in rated)
        out += [RunData(run.candidate, run.mode, base, run.requests) for r, run in rated if abs(r - target) == best]
    return out


def runs_from_stored(run: dict) -> list[RunData]:
    """The measured runs of ``Store.get_run(run_id)`` (with timelines: the latencies need every token); a
    capacity search's probes (stored one per rate, ``mix@rate/s``) reduced to the probe at each capacity."""
    out = []
    for r in run.get("results") or ():
        record = r.get("record")
        if r.get("status") != "measured" or not isinstance(record, dict):
            continue
        out.append(RunData(str(r["candidate"]), _mode(r.get("mode") or record.get("mode")), str(r.get("mix") or "-"),
                           tuple(x for x in record.get("requests") or () if isinstance(x, dict))))
    return at_capacity(out, find_curves(run))


# ---- deriving -------------------------------------------------------------------------------

def latencies(runs: list[RunData]) -> tuple[Latencies, ...]:
    """TTFT and every inter-token gap of the finished requests, per candidate and mix (recovery runs left out)."""
    pooled: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for run in runs:
        if RECOVERY_MARK in run.candidate or RECOVERY_MARK in run.mix:
            continue
        ttft, itl = pooled.setdefault((run.candidate, run.mix), ([], []))
        for req in _finished(run.requests):
            if req.get("ttft_s") is not None:
                ttft.append(req["ttft_s"] * 1e3)
            times = req.get("token_times_s") or []
            itl.extend((b - a) * 1e3 for a, b in zip(times, times[1:]))
    return tuple(Latencies(c, m, tuple(sorted(t)), tuple(sorted(i))) for (c, m), (t, i) in pooled.items())


def projections(runs: list[RunData], *, ttft_budget_ms: float, target_share: float = 0.9
                ) -> tuple[TwoBoxProjection, ...]:
    """The two-box projection of every disaggregated candidate on every mix it ran."""
    grouped: dict[tuple[str, str], list[RunData]] = {}
    for run in runs:
        if run.mode is Mode.DISAGGREGATED and RECOVERY_MARK not in run.mix:
            grouped.setdefault((run.candidate, run.mix), []).append(run)
    out = []
    for (cand, mix), rs in grouped.items():
        done = [req for run in rs for req in _finished(run.requests)]
        samples = [HandoffSample(int(req.get("n_prompt_tokens") or 0), req.get("kv_bytes"), req.get("ttft_s"),
                                 req.get("request_class", RequestClass.INTERACTIVE.value)
                                 == RequestClass.INTERACTIVE.value) for req in done]
        handoff_ms = [req["kv_transfer_s"] * 1e3 for req in done if req.get("kv_transfer_s") is not None]
        out.append(project(cand, mix, samples, ttft_budget_ms=ttft_budget_ms, target_share=target_share,
                           measured_handoff_ms=handoff_ms))
    return tuple(out)


def pictures(title: str, runs: list[RunData], curve_source, *, ttft_budget_ms: float,
             target_share: float = 0.9) -> Pictures:
    """The pictures of one advise run: ``runs`` for latencies and the projection, curves found in
    ``curve_source`` (the JSON-ready result or the stored run)."""
    return Pictures(title, find_curves(curve_source), latencies(runs),
                    projections(runs, ttft_budget_ms=ttft_budget_ms, target_share=target_share))


def cdf(values_ms: tuple[float, ...], max_points: int = 200) -> tuple[list[float], list[float]]:
    """(x ms, share of values <= x) of sorted ``values_ms``, thinned to at most ``max_points`` (ends kept)."""
    n = len(values_ms)
    if n == 0:
        return [], []
    idx = range(n) if n <= max_points else sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [values_ms[i] for i in idx], [(i + 1) / n for i in idx]


def p99(values_ms: tuple[float, ...]) -> float | None:
    return percentile(list(values_ms), 99)


def _finished(requests) -> list[dict]:
    return [r for r in requests if r.get("state") == "finished"]


def _mode(value) -> Mode | None:
    try:
        return Mode(value)
    except ValueError:
        return None


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


_DEFAULT = EngineConfig().class_budgets[RequestClass.INTERACTIVE]


def result_budgets_ms(result) -> tuple[float, float | None]:
    """(TTFT, ITL) budget of the interactive class as the live ``result``'s SLO holds them."""
    slo = result.settings.slo
    return float(slo.ttft_ms), _itl(slo)


def run_budgets_ms(run: dict) -> tuple[float, float | None]:
    """(TTFT, ITL) budget of the interactive class of a stored advise run (its SLO, else its engine config,
    else today's defaults)."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    slo = ((config.get("settings") or {}).get("slo") or {}) if isinstance(config.get("settings"), dict) else {}
    base = config.get("base") if isinstance(config.get("base"), dict) else {}
    ttft = slo.get("ttft_ms") or base.get("ttft_budget_ms") or _DEFAULT.ttft_ms
    itl = slo.get("itl_ms") or slo.get("tpot_ms") or base.get("itl_budget_ms") or _DEFAULT.itl_ms
    return float(ttft), None if itl is None else float(itl)


def result_projections(result) -> tuple[TwoBoxProjection, ...]:
    """The two-box rows of ``result``'s disaggregated runs (projected, not measured)."""
    ttft_ms, _ = result_budgets_ms(result)
    return projections(runs_from_result(result), ttft_budget_ms=ttft_ms)


def projections_plain(result) -> list[dict]:
    """``result_projections`` as JSON-ready data (each row says ``"note": "projected, not measured"``)."""
    return to_plain(list(result_projections(result)))


def _itl(slo) -> float | None:
    # why getattr: the SLO's per-token field is ``itl_ms`` (every gap) or, in older settings, ``tpot_ms``
    value = getattr(slo, "itl_ms", None) or getattr(slo, "tpot_ms", None)
    return None if value is None else float(value)
