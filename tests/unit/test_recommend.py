"""The recommendation rule on constructed evidence (pure: no engine, no model)."""
from homepd.advise.campaign.recommend import Candidate, Evidence, Measurement, recommend

CO64 = Candidate("colocated-chunk-64", "colocated", chunk=64)
CO_NONE = Candidate("colocated-unchunked", "colocated", chunk=None)
DIS = Candidate("disaggregated", "disaggregated", chunk=256)
REP = Candidate("replicas-2", "replicas", chunk=256, n_replicas=2)


def m(goodput, slowdown=None, samples=10, ttft_ok=1.0, tpot_ok=1.0, itl_p99=50.0, n=10):
    return Measurement(goodput_per_s=goodput, slo_attainment=min(ttft_ok, tpot_ok), ttft_attainment=ttft_ok,
                       tpot_attainment=tpot_ok, ttft_ms_p99=1000.0, itl_ms_p99=itl_p99,
                       interference_slowdown=slowdown, interference_samples=samples, n_requests=n)


def evidence(runs, candidates=(CO_NONE, CO64, DIS)):
    ev = Evidence(list(candidates))
    for (name, mix), ms in runs.items():
        for x in ms:
            ev.add(name, mix, x)
    return ev


def test_disaggregation_wins_when_interference_is_measured_slos_met_and_margin_clear():
    rec = recommend(evidence({
        ("colocated-unchunked", "mixed"): [m(0.3, slowdown=8.0), m(0.32, slowdown=7.5)],
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=2.0), m(0.52, slowdown=2.1)],
        ("disaggregated", "mixed"): [m(0.8, slowdown=1.05), m(0.82, slowdown=1.04)],
    }))
    assert rec.candidate == DIS and rec.rule == "disaggregated-wins" and rec.config["mode"] == "disaggregated"
    assert rec.confidence == "high" and "x1.59" in rec.reason


def test_disaggregation_loses_to_chunked_colocated_without_a_clear_margin():
    rec = recommend(evidence({
        ("colocated-unchunked", "mixed"): [m(0.3, slowdown=8.0)],
        ("colocated-chunk-64", "mixed"): [m(0.6, slowdown=2.0)],
        ("disaggregated", "mixed"): [m(0.65)],
    }))
    assert rec.candidate == CO64 and rec.rule == "disaggregated-no-clear-margin"
    assert rec.config == {"mode": "colocated", "chunk": 64, "adaptive_chunk": False}


def test_disaggregation_that_misses_the_ttft_target_is_not_recommended_even_with_more_goodput():
    rec = recommend(evidence({
        ("colocated-chunk-64", "mixed"): [m(0.3, slowdown=3.0)],
        ("disaggregated", "mixed"): [m(0.9, ttft_ok=0.5)],
    }))
    assert rec.candidate == CO64 and rec.rule == "disaggregated-misses-slo" and "50%" in rec.reason


def test_replicas_win_when_they_have_the_best_goodput():
    rec = recommend(evidence({
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.5)],
        ("replicas-2", "mixed"): [m(0.9, slowdown=1.4)],
        ("disaggregated", "mixed"): [m(0.7)],
    }, candidates=(CO64, REP, DIS)))
    assert rec.candidate == REP and rec.config == {"mode": "replicas", "chunk": 256, "adaptive_chunk": False, "n_replicas": 2}


def test_infeasible_disaggregation_is_listed_with_its_reason_and_colocated_recommended():
    nofit = Candidate("disaggregated", "disaggregated", feasible=False, reason="model + KV does not fit twice")
    rec = recommend(evidence({("colocated-chunk-64", "mixed"): [m(0.5, slowdown=5.0)],
                              ("colocated-unchunked", "mixed"): [m(0.4, slowdown=9.0)]},
                             candidates=(CO_NONE, CO64, nofit)))
    assert rec.candidate == CO64 and rec.rule == "colocated-best-goodput"
    assert rec.infeasible == (("disaggregated", "model + KV does not fit twice"),)


def test_a_disaggregated_run_that_handed_off_nothing_is_named_unranked_not_unmeasured():
    ev = evidence({("colocated-chunk-64", "mixed"): [m(0.5, slowdown=5.0)],
                   ("disaggregated", "mixed"): [m(0.9, slowdown=1.0)]}, candidates=(CO64, DIS))
    ev.not_exercised[("disaggregated", "mixed")] = "no KV was handed off"
    rec = recommend(ev)
    assert rec.candidate == CO64 and rec.rule == "colocated-best-goodput"
    assert "disaggregated ran but is not ranked (no KV was handed off)" in rec.reason
    assert "not measured" not in rec.reason
    alone = recommend(evidence({("colocated-chunk-64", "mixed"): [m(0.5, slowdown=5.0)]}, candidates=(CO64,)))
    assert alone.reason.endswith("disaggregation was not measured")


def test_insignificant_interference_keeps_colocated_even_when_disaggregation_has_more_goodput():
    rec = recommend(evidence({
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.1)],
        ("colocated-unchunked", "mixed"): [m(0.5, slowdown=1.15, samples=50)],
        ("disaggregated", "mixed"): [m(0.9)],
    }))
    assert rec.candidate.mode == "colocated" and rec.rule == "interference-not-significant"
    too_few = recommend(evidence({
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=5.0, samples=1)],
        ("disaggregated", "mixed"): [m(0.9)],
    }))
    assert too_few.rule == "interference-not-significant"


def test_the_answer_differs_by_prompt_mix_and_says_so():
    rec = recommend(evidence({
        ("colocated-chunk-64", "short"): [m(2.0, slowdown=1.0)],
        ("disaggregated", "short"): [m(1.0)],
        ("colocated-chunk-64", "long"): [m(0.2, slowdown=6.0)],
        ("disaggregated", "long"): [m(0.5)],
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=4.0)],
        ("disaggregated", "mixed"): [m(0.55)],
    }))
    answers = {a.mix: a.candidate for a in rec.per_mix}
    assert answers == {"short": "colocated-chunk-64", "long": "disaggregated", "mixed": "colocated-chunk-64"}
    assert not rec.mixes_agree and "differs by prompt mix" in rec.reason and rec.candidate == CO64
    assert {r.mix for r in rec.table} == {"short", "long", "mixed"}  # the mix is a dimension of the table


def test_confidence_is_low_when_the_lead_is_within_the_repeat_spread():
    rec = recommend(evidence({
        ("colocated-chunk-64", "mixed"): [m(0.50, slowdown=1.0), m(0.70, slowdown=1.0)],
        ("colocated-unchunked", "mixed"): [m(0.55, slowdown=1.0), m(0.60, slowdown=1.0)],
    }, candidates=(CO_NONE, CO64)))
    assert rec.confidence == "low" and "spread" in rec.confidence_why


def test_interference_is_read_from_a_run_with_enough_samples_not_a_single_outlier():
    rec = recommend(evidence({
        ("colocated-unchunked", "mixed"): [m(0.3, slowdown=40.0, samples=1)],   # one disturbed step
        ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=2.5, samples=12)],
        ("disaggregated", "mixed"): [m(0.9)],
    }))
    assert rec.rule == "disaggregated-wins" and "x2.50 over 12 disturbed steps" in rec.reason


def curve(name, capacity, spread, mix="mixed"):
    from homepd.advise.campaign.capacity import CapacityCurve, Probe
    probes = (Probe(capacity, 10, 1.0, capacity, 0, 10 / capacity, {"interactive": 1.0}),)
    if spread is not None:  # None: nothing failed above it (a lower bound)
        probes += (Probe(capacity + spread, 10, 0.5, None, 0, 10, {"interactive": 0.5}, {"every gap <= 100 ms": 5}),)
    return CapacityCurve(name, mix, 0.9, spread or 0.1, probes, capacity, spread, "every gap <= 100 ms")


def with_capacity(ev, curves):
    for c in curves:
        ev.capacity[(c.candidate, c.mix)] = c
    return ev


def test_capacity_ranks_the_candidates_not_goodput_at_one_rate():
    ev = with_capacity(evidence({("colocated-unchunked", "mixed"): [m(0.9, slowdown=1.0)],
                                 ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.0)]},
                                candidates=(CO_NONE, CO64)),
                       [curve("colocated-unchunked", 0.5, 0.1), curve("colocated-chunk-64", 1.0, 0.19)])
    rec = recommend(ev)
    assert rec.candidate == CO64 and rec.rule == "colocated-best-capacity" and "1.00 ± 0.19 req/s" in rec.reason
    assert rec.tied_with == () and {r.candidate: r.capacity_rps for r in rec.table}["colocated-chunk-64"] == 1.0


def test_candidates_within_each_others_spread_are_reported_as_a_tie():
    ev = with_capacity(evidence({("colocated-unchunked", "mixed"): [m(0.5, slowdown=1.0)],
                                 ("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.0)]},
                                candidates=(CO_NONE, CO64)),
                       [curve("colocated-unchunked", 0.84, 0.16), curve("colocated-chunk-64", 1.0, 0.19)])
    rec = recommend(ev)
    assert rec.candidate == CO64 and rec.tied_with == ("colocated-unchunked",)
    assert "colocated-chunk-64 and colocated-unchunked are within the measurement spread" in rec.reason
    assert rec.confidence == "low" and rec.confidence_why.startswith("a tie")


def test_disaggregation_needs_a_clear_capacity_margin_too():
    runs = {("colocated-chunk-64", "mixed"): [m(0.5, slowdown=3.0)], ("disaggregated", "mixed"): [m(0.5)]}
    close = recommend(with_capacity(evidence(runs), [curve("colocated-chunk-64", 1.0, 0.19),
                                                     curve("disaggregated", 1.19, 0.22)]))
    assert close.candidate == CO64 and close.rule == "disaggregated-no-clear-margin"
    clear = recommend(with_capacity(evidence(runs), [curve("colocated-chunk-64", 1.0, 0.19),
                                                     curve("disaggregated", 2.0, 0.38)]))
    assert clear.candidate == DIS and clear.rule == "disaggregated-wins" and clear.tied_with == ()
    # nothing failed on the colocated search (a lower bound): twice its rate is no clear margin
    bound = recommend(with_capacity(evidence(runs), [curve("colocated-chunk-64", 1.0, None),
                                                     curve("disaggregated", 2.0, 0.38)]))
    assert bound.candidate == CO64 and bound.rule == "disaggregated-no-clear-margin"
    assert "only a lower bound (1.00 or more req/s: nothing failed)" in bound.reason


def test_when_no_rate_passed_anywhere_every_candidate_is_a_tie_ranked_by_goodput_at_the_slowest_probe():
    from dataclasses import replace
    ev = evidence({("colocated-unchunked", "mixed"): [m(0.02, slowdown=9.0)],
                   ("colocated-chunk-64", "mixed"): [m(0.07, slowdown=2.0)]}, candidates=(CO_NONE, CO64))
    for c in (curve("colocated-unchunked", 0.5, 0.0), curve("colocated-chunk-64", 0.5, 0.0)):
        ev.capacity[(c.candidate, c.mix)] = replace(c, capacity_rps=None, spread_rps=None, probes=c.probes[1:])
    rec = recommend(ev)
    assert rec.candidate == CO64 and rec.tied_with == ("colocated-unchunked",) and rec.confidence == "low"
    assert "no rate passed; goodput 0.07 req/s at the slowest probe" in rec.reason


def twin_curve(name, capacity, interval, at_half=None, mix="mixed"):
    """A twin's capacity as the campaign stores it: an interval both sides, its attainment at half the capacity."""
    from homepd.advise.campaign.capacity import CapacityCurve
    return CapacityCurve(name, mix, 0.9, capacity * 0.09, (), capacity, None, "every gap <= 100 ms",
                         interval_rps=interval, source="twin", attainment_at_half=at_half)


def test_twins_with_intervals_apart_give_high_confidence_unless_a_curve_is_flat():
    runs = {("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.0)], ("colocated-unchunked", "mixed"): [m(0.4)]}
    steep = recommend(with_capacity(evidence(runs, candidates=(CO_NONE, CO64)), [
        twin_curve("colocated-chunk-64", 0.68, (0.6, 0.71), at_half=1.0),
        twin_curve("colocated-unchunked", 0.30, (0.25, 0.30), at_half=0.99)]))
    assert steep.candidate == CO64 and steep.confidence == "high" and "intervals are apart" in steep.confidence_why
    # the runner-up still misses nearly what the target allows at half its capacity: its misses are noise
    flat = recommend(with_capacity(evidence(runs, candidates=(CO_NONE, CO64)), [
        twin_curve("colocated-chunk-64", 0.68, (0.6, 0.71), at_half=1.0),
        twin_curve("colocated-unchunked", 0.30, (0.25, 0.30), at_half=0.92)]))
    assert flat.candidate == CO64 and flat.confidence == "medium"
    assert "colocated-unchunked meets the SLO for only 92% of requests at half its capacity" in flat.confidence_why


def test_twins_within_a_few_percent_are_an_answer_with_the_figure_not_a_tie():
    runs = {("colocated-chunk-64", "mixed"): [m(0.5, slowdown=1.0)], ("colocated-unchunked", "mixed"): [m(0.5)]}
    rec = recommend(with_capacity(evidence(runs, candidates=(CO_NONE, CO64)), [
        twin_curve("colocated-chunk-64", 0.70, (0.66, 0.74), at_half=1.0),
        twin_curve("colocated-unchunked", 0.68, (0.64, 0.71), at_half=1.0)]))
    assert rec.confidence == "medium" and rec.confidence_why.startswith("within 3%: either serves this box")


def test_a_colocated_capacity_under_its_only_failed_probe_is_not_beaten_by_a_disaggregated_one_below_it():
    """A colocated twin that failed its check (8 of 12 at 0.65 req/s) leaves one failing probe: its capacity lies
    somewhere under 0.65, not at 0, so a disaggregated twin's 0.41 is not "x inf" ahead; one at 0.80 is."""
    from dataclasses import replace
    from homepd.advise.campaign.capacity import CapacityCurve, Probe
    co = Candidate("colocated-adaptive", "colocated", chunk=256)
    failed = CapacityCurve("colocated-adaptive", "mixed", 0.9, 0.1,
                           (Probe(0.65, 12, 8 / 12, None, 0, 18.5, {"interactive": 0.7}, {"every gap <= 100 ms": 4}),),
                           None, None, "every gap <= 100 ms")
    runs = {("colocated-adaptive", "mixed"): [m(0.39, slowdown=2.2, samples=144)], ("disaggregated", "mixed"): [m(0.4)]}
    below = recommend(with_capacity(evidence(runs, candidates=(co, DIS)),
                                    [failed, twin_curve("disaggregated", 0.41, (0.32, 0.55))]))
    assert below.candidate == co and below.rule == "disaggregated-no-clear-margin"
    assert "capacity lies somewhere under 0.65 req/s" in below.reason
    assert below.tied_with == ("disaggregated",) and below.confidence == "low"
    above = recommend(with_capacity(evidence(runs, candidates=(co, DIS)),
                                    [failed, replace(twin_curve("disaggregated", 0.80, (0.74, 0.86)))]))
    assert above.candidate == DIS and above.rule == "disaggregated-wins" and not above.tied_with
