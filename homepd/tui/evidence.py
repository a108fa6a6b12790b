"""Advise evidence for the app: a live ``AdviseResult`` or a stored run -> one ``AdviseView``.

The advise screen and the history screen show the same view: ``EvidenceRow``s, one per candidate and prompt
mix (``homepd.advise.report.render.evidence_rows`` for a live result, the probes of a stored ``Run``), and the
advice and pictures of the run (a live result's ``AdviseResult.run``).  Pure: no Textual, no I/O.
"""
from __future__ import annotations

import statistics

from homepd.advise.report.pictures import run_pictures
from homepd.advise.report.render import campaign_shape, evidence_rows
from homepd.store.records import MEASURED, Run, RunAdvice, RunProbe
from homepd.tui.records import AdviseStep, AdviseView, EvidenceRow, RecommendationView

MIB = 2 ** 20


def step_from_progress(p) -> AdviseStep:
    """``homepd.advise.campaign.run.Progress`` -> ``AdviseStep`` (the candidate is the one the campaign names)."""
    return AdviseStep(p.done, p.total, p.current, p.candidate, p.elapsed_s, p.eta_s)


def recommendation_view(advice: RunAdvice | None) -> RecommendationView | None:
    """From a run's advice (``Run.advice``: a live result's or a stored one's)."""
    if advice is None or not advice.rule:
        return None
    return RecommendationView(
        candidate=advice.candidate.name if advice.candidate is not None else None, config=dict(advice.config),
        rule=advice.rule, reason=advice.reason, confidence=advice.confidence or "?",
        confidence_why=advice.confidence_why, per_mix=tuple((m.mix, m.candidate) for m in advice.per_mix))


def from_result(result) -> AdviseView:
    """The view of a finished ``homepd.advise.campaign.run.AdviseResult``: the evidence table's rows (medians
    over repeats), its advice and pictures as its ``run``'s."""
    rows = []
    for r in evidence_rows(result):
        if "infeasible" in r:
            rows.append(EvidenceRow(r["candidate"], "-", infeasible=r["infeasible"]))
            continue
        rows.append(EvidenceRow(
            candidate=r["candidate"], mix=r["mix"], n_repeats=r["repeats"],
            goodput_per_s=r["goodput_per_s"], slo_attainment=r["slo_attainment"],
            ttft_ms_p99=r["ttft_ms_p99"], tpot_ms_p50=r["tpot_ms_p50"], itl_ms_p99=r["itl_ms_p99"],
            itl_ms_max=r["itl_ms_max"], output_tok_s=r["output_tok_s"], interference=r["interference"],
            kv_transfer_ms=r["kv_transfer_ms_p50"], pss_mib=r["total_pss_mib"]))
    s = result.settings
    notes = [f"{campaign_shape(s)}; SLO {s.slo.describe()}; medians over repeats; wall {result.wall_s:.0f} s"]
    if result.predicted_chunk is not None:
        notes.append(f"step-time model: chunk {result.predicted_chunk} keeps a decode step under the ITL target")
    run = result.run
    return AdviseView(result.run_id, _title(run), tuple(rows), recommendation_view(run.advice), tuple(notes),
                      *_pictures(run))


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def from_stored_run(run: Run) -> AdviseView:
    """The view of a run as ``Store.load_run(run_id)`` returns it: per candidate and mix (each capacity probe
    a mix of its own), the means over repeats."""
    groups: dict[tuple, list[RunProbe]] = {}
    for p in run.probes:
        groups.setdefault((p.candidate, p.mix, p.status), []).append(p)
    rows = []
    for (candidate, mix, status), ps in groups.items():
        if status != MEASURED:
            rows.append(EvidenceRow(candidate, mix or "-", infeasible=ps[0].reason or status or "?"))
            continue
        pss = _mean(p.total_pss_bytes for p in ps)
        rows.append(EvidenceRow(
            candidate, mix or "-", n_repeats=len(ps), goodput_per_s=_mean(p.goodput_per_s for p in ps),
            slo_attainment=_mean(p.slo_attainment for p in ps), ttft_ms_p99=_mean(p.ttft_p99_ms for p in ps),
            tpot_ms_p50=_mean(p.tpot_p50_ms for p in ps), itl_ms_p99=_mean(p.itl_p99_ms for p in ps),
            itl_ms_max=_mean(p.itl_max_ms for p in ps), output_tok_s=_mean(p.output_tok_s for p in ps),
            interference=_mean(p.interference_slowdown for p in ps),
            kv_transfer_ms=_mean(p.kv_transfer_ms_p50 for p in ps), pss_mib=None if pss is None else pss / MIB))
    rec = recommendation_view(run.advice)
    notes = [f"{run.kind} run, {run.status}; started {run.started_at or '?'}; means over repeats"]
    if run.error:
        notes.append(f"error: {run.error}")
    if rec is None and run.n_recommendations:
        notes.append(f"recommendation: {run.headline or '(no headline)'}")
    return AdviseView(run.id, f"run {run.id}", tuple(rows), rec, tuple(notes), *_pictures(run))


def _title(run: Run) -> str:
    return f"advise run {run.id}" if run.id is not None else "advise run (not stored)"


def _pictures(run: Run) -> tuple:
    """(pictures, TTFT budget ms, ITL budget ms) of a run."""
    return (run_pictures(run), *run.config.budgets_ms)
