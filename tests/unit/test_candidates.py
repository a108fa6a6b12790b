"""A candidate must run as named: where each run's prompts were prefilled, the flag on a disaggregated
candidate that handed nothing off, and the rule that does not rank it (pure: constructed lifecycles and
evidence, no engine)."""
from __future__ import annotations

import types

from homepd.advise.campaign.exercised import PrefillSplit, not_exercised, prefill_split
from homepd.advise.campaign.recommend import Candidate, Evidence, Measurement, recommend
from homepd.advise.report.render import render_table
from homepd.core.lifecycle import Lifecycle, RequestState

CO = Candidate("colocated-adaptive", "colocated", chunk=256, adaptive_chunk=True)
DIS = Candidate("disaggregated", "disaggregated", chunk=256)
ROUTED = Candidate("disaggregated-routed", "disaggregated", chunk=256, local_prefill=True)


def finished(request_id: str, n_prompt: int, handed_off: bool, kv_bytes_per_token: int = 1000) -> Lifecycle:
    """A request's lifecycle as the controller leaves it: prefilled, handed off (or not), decoded, finished."""
    lc = Lifecycle(request_id, arrived_s=0.0, n_prompt_tokens=n_prompt)
    lc.advance(RequestState.PREFILLING, 0.1)
    lc.prefill_end_s = 0.5
    if handed_off:
        lc.advance(RequestState.TRANSFERRING, 0.5)
        lc.kv_bytes, lc.transfer_end_s = n_prompt * kv_bytes_per_token, 0.6
    lc.advance(RequestState.DECODING, 0.6)
    lc.add_token(0.6)
    lc.add_token(0.7)
    lc.advance(RequestState.FINISHED, 0.7)
    return lc


def record(*requests):
    return types.SimpleNamespace(requests=list(requests))


def test_each_runs_prompts_are_counted_where_they_were_prefilled():
    failed_early = Lifecycle("x", arrived_s=0.0, n_prompt_tokens=50)
    failed_early.advance(RequestState.FAILED, 0.2)
    requests = [finished("a", 400, True), finished("b", 20, False), finished("c", 30, False), failed_early]
    split = prefill_split(requests)  # a run record's lifecycles
    assert prefill_split([lc.timings() for lc in requests]) == split  # or the stored timings
    assert split == PrefillSplit(n_local_prompts=2, n_local_tokens=50, n_handoff_prompts=1, n_handoff_tokens=400)
    assert split.describe() == "2 prompts (50 tokens) prefilled where they decode, 1 (400 tokens) handed off"


def test_a_disaggregated_candidate_that_handed_nothing_off_on_a_mix_is_flagged_on_that_mix_only():
    records = {
        ("disaggregated-routed", "mixed", 0): record(finished("a", 400, False), finished("b", 20, False)),
        ("disaggregated-routed", "mixed", 1): record(finished("c", 300, False)),
        ("disaggregated-routed", "long", 0): record(finished("d", 400, True)),
        ("disaggregated", "mixed", 0): record(finished("e", 400, True), finished("f", 20, True)),
        ("colocated-adaptive", "mixed", 0): record(finished("g", 400, False)),  # colocated: local by definition
    }
    flags = not_exercised([CO, DIS, ROUTED], records)
    assert set(flags) == {("disaggregated-routed", "mixed")}
    assert "all 3 prompts (720 tokens) were prefilled on the decode worker" in flags[("disaggregated-routed", "mixed")]


def m(goodput, slowdown=None, n=10):
    return Measurement(goodput_per_s=goodput, slo_attainment=1.0, ttft_attainment=1.0, tpot_attainment=1.0,
                       ttft_ms_p99=1000.0, itl_ms_p99=50.0, interference_slowdown=slowdown, interference_samples=10,
                       n_requests=n)


def test_a_candidate_that_did_not_run_as_named_is_shown_but_not_ranked():
    ev = Evidence([CO, DIS, ROUTED])
    ev.add("colocated-adaptive", "mixed", m(0.5, slowdown=3.0))
    ev.add("disaggregated", "mixed", m(0.55))
    ev.add("disaggregated-routed", "mixed", m(0.9))  # the best goodput, but it moved no KV
    assert recommend(ev).candidate == ROUTED          # ranked, it would win
    ev.not_exercised = {("disaggregated-routed", "mixed"): "no KV was handed off"}
    rec = recommend(ev)
    assert rec.candidate == CO and rec.rule == "disaggregated-no-clear-margin"  # judged on the real one
    assert "disaggregated-routed" in {r.candidate for r in rec.table}          # still in the evidence


def test_the_evidence_table_marks_the_unranked_row_and_says_where_prompts_were_prefilled():
    rows = [{"candidate": "disaggregated", "mix": "mixed", "prefill_local_prompts": 1, "prefill_handoff_prompts": 7,
             "not_exercised": None},
            {"candidate": "disaggregated-routed", "mix": "mixed", "prefill_local_prompts": 8,
             "prefill_handoff_prompts": 0, "not_exercised": "no KV was handed off"}]
    text = render_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["candidate", "mix"] and "loc/hand" in lines[0]
    assert "1/7" in lines[2] and "(!)" not in lines[2]
    assert lines[3].startswith("disaggregated-routed (!)") and "8/0" in lines[3]
    assert lines[-1] == "(!) not ranked: disaggregated-routed on mixed: no KV was handed off"
