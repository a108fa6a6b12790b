"""The evidence live advice compares the traffic with: the latest advise run of the served model, as stored.

``load_live_evidence(store, model, box=...)`` reads, of the newest run measured on this box, its capacity
curves (one ``EvidenceRow`` per candidate and mix), the feasible candidates' configurations (what
``POST /advice/apply`` switches to) and each mix's request shape, measured from the requests its probes sent
(``mix_shape``).  Blocking: call it off the event loop.
"""
from __future__ import annotations

import statistics

from homepd.advise.live.advice import EvidenceRow, LiveEvidence, MixShape
from homepd.hw.probe import BoxIdentity
from homepd.measure.trace.model import LONG_PROMPT_TOKENS
from homepd.store.evidence import advise_runs, request_shapes
from homepd.store.records import RunAdvice


def mix_shape(mix: str, requests: list[tuple[int, int, str]]) -> MixShape:
    """The shape of ``requests`` ((prompt tokens, output tokens, class) each, at least one)."""
    prompts = sorted(p for p, _, _ in requests)
    n = len(requests)
    return MixShape(mix, n, long_share=sum(p >= LONG_PROMPT_TOKENS for p in prompts) / n,
                    background_share=sum(c == "background" for _, _, c in requests) / n,
                    prompt_tokens_p50=float(statistics.median(prompts)),
                    prompt_tokens_p90=float(prompts[min(n - 1, int(0.9 * n))]),
                    mean_output_tokens=statistics.fmean(o for _, o, _ in requests))


def evidence_rows(run_id: int, advice: RunAdvice) -> tuple[EvidenceRow, ...]:
    """The capacity curves of a stored recommendation as rows (a curve without probes, or whose runs did not
    exercise its architecture, is left out: the campaign does not rank those either)."""
    return tuple(EvidenceRow(run_id, c.candidate, c.mix, c.capacity_rps, c.spread_rps,
                             max(p.rate_rps for p in c.probes), c.decided_by)
                 for c in advice.capacity if c.probes and advice.is_exercised(c.candidate, c.mix))


def load_live_evidence(store, model: str, known: LiveEvidence | None = None,
                       box: BoxIdentity | None = None) -> LiveEvidence | None:
    """The latest advise run of ``model`` measured on ``box`` (this box; None: any) as ``LiveEvidence``; None
    when the store holds none.  A run that stored no hardware probe counts as this box's.  When every run was
    measured on another box (the store copied over, a CPU or GPU changed), the evidence is the newest one's
    with no rows and ``foreign`` saying so: its capacities do not hold here.  ``known``: the evidence already
    read, returned as it is when no newer run has been stored (a periodic re-read then costs one query, not
    the run's curves and requests again)."""
    runs = advise_runs(store, model)
    if not runs:
        return None
    here = [(run_id, measured) for run_id, measured in ((r, BoxIdentity.of(hw)) for r, hw in runs)
            if box is None or measured is None or measured == box]
    if not here:
        run_id, hardware = runs[0]
        elsewhere = BoxIdentity.of(hardware)
        return LiveEvidence(run_id, model, (), {}, measured_on=elsewhere.describe(), foreign=(
            f"the advise runs of this model were measured on another box (run {run_id}: {elsewhere.describe()}; "
            f"this box: {box.describe()}): their capacities do not hold here"))
    run_id, measured = here[0]
    if known is not None and known.run_id == run_id and known.model == model and not known.foreign:
        return known
    advice = store.load_run(run_id, timelines=False).advice
    configs = {c.name: c.config_values() for c in advice.candidates if c.feasible}
    shapes = {mix: mix_shape(mix, reqs) for mix, reqs in request_shapes(store, run_id).items() if reqs}
    return LiveEvidence(run_id, model, evidence_rows(run_id, advice), shapes, configs,
                        measured_on=measured.describe() if measured is not None else None,
                        twins=tuple(t for t in advice.twins if t.config is not None))
