"""The evidence live advice compares the traffic with: the latest advise run of the served model, as stored.

``load_live_evidence(store, model)`` reads its capacity curves (one ``EvidenceRow`` per candidate and mix),
the feasible candidates' configurations (what ``POST /advice/apply`` switches to) and each mix's request
shape, measured from the requests its probes sent (``mix_shape``).  Blocking: call it off the event loop.
"""
from __future__ import annotations

import statistics

from homepd.advise.apply import stored_candidates
from homepd.advise.live import EvidenceRow, LiveEvidence, MixShape
from homepd.measure.trace.model import LONG_PROMPT_TOKENS
from homepd.store.evidence import latest_advise_run, request_shapes


def mix_shape(mix: str, requests: list[tuple[int, int, str]]) -> MixShape:
    """The shape of ``requests`` ((prompt tokens, output tokens, class) each, at least one)."""
    prompts = sorted(p for p, _, _ in requests)
    n = len(requests)
    return MixShape(mix, n, long_share=sum(p >= LONG_PROMPT_TOKENS for p in prompts) / n,
                    background_share=sum(c == "background" for _, _, c in requests) / n,
                    prompt_tokens_p50=float(statistics.median(prompts)),
                    prompt_tokens_p90=float(prompts[min(n - 1, int(0.9 * n))]),
                    mean_output_tokens=statistics.fmean(o for _, o, _ in requests))


def evidence_rows(run_id: int, recommendation: dict) -> tuple[EvidenceRow, ...]:
    """The capacity curves of a stored recommendation as rows (a curve without probes, or whose runs did not
    exercise its architecture, is left out: the campaign does not rank those either)."""
    skipped = {(f.get("candidate"), f.get("mix")) for f in recommendation.get("not_exercised") or ()}
    rows = []
    for curve in recommendation.get("capacity") or ():
        probes = curve.get("probes") or ()
        if not probes or (curve["candidate"], curve["mix"]) in skipped:
            continue
        rows.append(EvidenceRow(run_id, curve["candidate"], curve["mix"], curve.get("capacity_rps"),
                                curve.get("spread_rps"), max(p["rate_rps"] for p in probes),
                                curve.get("decided_by") or ""))
    return tuple(rows)


def load_live_evidence(store, model: str, known: LiveEvidence | None = None) -> LiveEvidence | None:
    """The latest advise run of ``model`` as ``LiveEvidence``; None when the store holds none.  ``known``: the
    evidence already read, returned as it is when no newer run has been stored (a periodic re-read then costs
    one query, not the run's curves and requests again)."""
    run_id = latest_advise_run(store, model)
    if run_id is None:
        return None
    if known is not None and known.run_id == run_id and known.model == model:
        return known
    run = store.get_run(run_id, timelines=False)
    rec = next(r["data"] for r in reversed(run["recommendations"]) if (r["data"] or {}).get("capacity"))
    configs = {c.name: c.config_values() for c in stored_candidates(rec) if c.feasible}
    shapes = {mix: mix_shape(mix, reqs) for mix, reqs in request_shapes(store, run_id).items() if reqs}
    return LiveEvidence(run_id, model, evidence_rows(run_id, rec), shapes, configs)
