"""Advise evidence for the app: a live ``AdviseResult`` or a stored run -> one ``AdviseView``.

The advise screen and the history screen show the same view, so both shapes
(``homepd.advise.report.render.evidence_rows`` for a live result, the store's result
rows for a past run) end up as ``EvidenceRow``s: one per candidate and prompt
mix.  Pure: no Textual, no I/O.
"""
from __future__ import annotations

import statistics

from homepd.advise.report.images import result_pictures, run_pictures
from homepd.advise.report.pictures import result_budgets_ms, run_budgets_ms
from homepd.advise.report.render import campaign_shape
from homepd.core.records import to_plain
from homepd.tui.records import AdviseStep, AdviseView, EvidenceRow, RecommendationView

MIB = 2 ** 20


def step_from_progress(p) -> AdviseStep:
    """``homepd.advise.campaign.run.Progress`` -> ``AdviseStep``; the candidate is the text before ' on the '
    (or after 'recovery: '), as the campaign words its steps."""
    current = p.current
    candidate = None
    if current.startswith("recovery: "):
        candidate = current[len("recovery: "):].split(",", 1)[0]
    elif " on the " in current:
        candidate = current.split(" on the ", 1)[0]
    return AdviseStep(p.done, p.total, current, candidate, p.elapsed_s, p.eta_s)


def recommendation_view(data: dict | None) -> RecommendationView | None:
    """From ``to_plain(Recommendation)`` (live, or as the store keeps it)."""
    if not isinstance(data, dict) or "rule" not in data:
        return None
    cand = data.get("candidate")
    per_mix = tuple((m.get("mix", "?"), m.get("candidate", "?")) for m in data.get("per_mix") or ()
                    if isinstance(m, dict))
    return RecommendationView(
        candidate=cand.get("name") if isinstance(cand, dict) else cand, config=dict(data.get("config") or {}),
        rule=str(data.get("rule") or ""), reason=str(data.get("reason") or ""),
        confidence=str(data.get("confidence") or "?"), confidence_why=str(data.get("confidence_why") or ""),
        per_mix=per_mix)


def from_result(result) -> AdviseView:
    """The view of a finished ``homepd.advise.campaign.run.AdviseResult``."""
    from homepd.advise.report.render import evidence_rows

    rows = []
    for r in evidence_rows(result):
        if "infeasible" in r:
            rows.append(EvidenceRow(r["candidate"], "-", infeasible=r["infeasible"]))
            continue
        rows.append(EvidenceRow(
            candidate=r["candidate"], mix=r["mix"], n_repeats=r.get("repeats", 0),
            goodput_per_s=r.get("goodput_per_s"), slo_attainment=r.get("slo_attainment"),
            ttft_ms_p99=r.get("ttft_ms_p99"), tpot_ms_p50=r.get("tpot_ms_p50"), itl_ms_p99=r.get("itl_ms_p99"),
            itl_ms_max=r.get("itl_ms_max"), output_tok_s=r.get("output_tok_s"), interference=r.get("interference"),
            kv_transfer_ms=r.get("kv_transfer_ms_p50"), pss_mib=r.get("total_pss_mib")))
    s = result.settings
    notes = [f"{campaign_shape(s)}; SLO {s.slo.describe()}; medians over repeats; wall {result.wall_s:.0f} s"]
    if result.predicted_chunk is not None:
        notes.append(f"step-time model: chunk {result.predicted_chunk} keeps a decode step under the ITL target")
    title = f"advise run {result.run_id}" if result.run_id is not None else "advise run (not stored)"
    return AdviseView(result.run_id, title, tuple(rows), recommendation_view(to_plain(result.recommendation)),
                      tuple(notes), *_pictures(result_pictures, result_budgets_ms, result))


# stored result column -> EvidenceRow field
STORED_FIELDS = {"goodput_per_s": "goodput_per_s", "slo_attainment": "slo_attainment",
                 "ttft_p99_ms": "ttft_ms_p99", "tpot_p50_ms": "tpot_ms_p50", "itl_p99_ms": "itl_ms_p99",
                 "itl_max_ms": "itl_ms_max", "output_tok_s": "output_tok_s",
                 "interference_slowdown": "interference"}


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _kv_transfer_ms(result: dict) -> float | None:
    try:
        return result["record"]["summary"]["kv"]["transfer_ms"]["p50"]
    except (KeyError, TypeError):
        return None


def from_stored_run(run: dict) -> AdviseView:
    """The view of a run as ``Store.get_run(run_id, timelines=False)`` returns it."""
    groups: dict[tuple, list[dict]] = {}
    for r in run.get("results") or ():
        groups.setdefault((r["candidate"], r.get("mix"), r.get("status")), []).append(r)
    rows = []
    for (candidate, mix, status), rs in groups.items():
        if status != "measured":
            rows.append(EvidenceRow(candidate, mix or "-", infeasible=rs[0].get("reason") or status or "?"))
            continue
        values = {field: _mean(r.get(column) for r in rs) for column, field in STORED_FIELDS.items()}
        pss = _mean(r.get("total_pss_bytes") for r in rs)
        rows.append(EvidenceRow(candidate, mix or "-", n_repeats=len(rs), **values,
                                kv_transfer_ms=_mean(_kv_transfer_ms(r) for r in rs),
                                pss_mib=None if pss is None else pss / MIB))
    recs = run.get("recommendations") or []
    rec = recommendation_view(recs[-1].get("data")) if recs else None
    notes = [f"{run.get('kind', '?')} run, {run.get('status', '?')}; started {run.get('started_at') or '?'}; "
             "means over repeats"]
    if run.get("error"):
        notes.append(f"error: {run['error']}")
    if recs and rec is None:
        notes.append(f"recommendation: {recs[-1].get('headline') or '(no headline)'}")
    return AdviseView(run.get("id"), f"run {run.get('id')}", tuple(rows), rec, tuple(notes),
                      *_pictures(run_pictures, run_budgets_ms, run))


def _pictures(draw, budgets, source) -> tuple:
    """(pictures, TTFT budget ms, ITL budget ms) of a live result or a stored run."""
    ttft_ms, itl_ms = budgets(source)
    return draw(source), ttft_ms, itl_ms
