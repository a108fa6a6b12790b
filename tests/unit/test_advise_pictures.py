"""The advise pictures: capacity curves read from the evidence (absent in older runs), latency distributions
from the run records' lifecycles, and the image file (a valid SVG and PNG naming every series)."""
from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
import pytest

from homepd.advise.report import pictures as pics
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.advise.campaign.recommend import Evidence, recommend
from homepd.advise.campaign.run import AdviseResult, AdviseSettings
from homepd.core.modes import Candidate, Mode
from homepd.core.records import from_stored, to_plain
from homepd.measure.curve import CapacityCurve as SearchCurve
from homepd.measure.metrics import summarize
from homepd.measure.replay import RunRecord
from homepd.store.records import Run, decode_run


def curve(candidate: str, mix: str, capacity: float | None, rates=(0.1, 0.2, 0.4, 0.8)) -> dict:
    """A ``CapacityCurve`` as ``to_plain`` writes it."""
    probes = [{"rate_rps": r, "n_requests": 20, "attainment": 1.0 if capacity and r <= capacity else 0.5,
               "goodput_rps": r, "seed": i, "duration_s": 20 / r, "per_class": {"interactive": 1.0}}
              for i, r in enumerate(rates)]
    return {"candidate": candidate, "mix": mix, "target_share": 0.9, "resolution_rps": 0.05, "probes": probes,
            "capacity_rps": capacity, "spread_rps": 0.05 if capacity else None, "decided_by": "every gap <= 100 ms"}


def request(ttft_s: float, gaps_s: list[float], *, n_prompt: int = 100, kv_bytes=None, state="finished",
            cls="interactive") -> dict:
    times = [10.0 + ttft_s]
    for g in gaps_s:
        times.append(times[-1] + g)
    return {"request_id": f"r{ttft_s}", "state": state, "n_prompt_tokens": n_prompt, "n_output_tokens": len(times),
            "ttft_s": ttft_s, "tpot_s": None, "token_times_s": times, "kv_bytes": kv_bytes,
            "kv_transfer_s": 0.004 if kv_bytes else None, "request_class": cls}


def stored_run(curves=()) -> Run:
    return decode_run(stored_dict(curves))


def stored_dict(curves=()) -> dict:
    """``Store.get_run(id)``'s shape: measured results with their records' request timelines."""
    def result(cand, mode, mix, reqs, status="measured"):
        return {"candidate": cand, "mix": mix, "status": status, "mode": mode,
                "record": {"mode": mode, "requests": reqs} if status == "measured" else None}
    return {"id": 12, "kind": "advise", "status": "complete", "config": {"base": {"ttft_budget_ms": 4000.0}},
            "recommendations": [{"data": {"rule": "x", "capacity": list(curves)}}], "results": [
        result("colocated-chunk-16", "colocated", "mixed", [request(0.5, [0.03, 0.05]), request(1.5, [0.2])]),
        result("colocated-chunk-16", "colocated", "mixed", [request(0.7, [0.04])]),           # a second repeat
        result("disaggregated", "disaggregated", "mixed",
               [request(0.9, [0.03], n_prompt=1000, kv_bytes=1000 * 30_000), request(3.0, [], state="failed")]),
        result("colocated-chunk-16+kill:colocated", "colocated", "mixed+kill", [request(9.0, [2.0])]),
        result("replicas-2", "replicas", "-", [], status="infeasible")]}


def test_curves_are_the_advice_s_and_older_runs_have_none():
    run = stored_run([curve("a", "mixed", 0.4), curve("d", "long", None), curve("a", "mixed", 0.9)])
    found = pics.run_curves(run)
    assert [(c.candidate, c.mix) for c in found] == [("a", "mixed"), ("d", "long")]   # the first of each kept
    a = found[0]
    assert a.points[0] == (0.1, 1.0) and a.capacity_rps == 0.4 and a.spread_rps == 0.05
    assert a.decided_by == "every gap <= 100 ms" and a.target_share == 0.9
    assert found[1].capacity_rps is None
    assert pics.run_curves(stored_run()) == ()


def test_probes_are_drawn_in_rate_order():
    data = curve("a", "mixed", 0.4, rates=(0.8, 0.1, 0.4, 0.2))
    assert [r for r, _ in pics.read_curve(from_stored(SearchCurve, data)).points] == [0.1, 0.2, 0.4, 0.8]
    # a rate probed on two seeds (the refinement's repeat) is one point: their mean
    twice = dict(data, probes=[*data["probes"], {**data["probes"][0], "attainment": 1.0}])
    points = dict(pics.read_curve(from_stored(SearchCurve, twice)).points)
    assert len(points) == 4 and points[data["probes"][0]["rate_rps"]] == (data["probes"][0]["attainment"] + 1.0) / 2 == 0.75


def test_latencies_pool_the_repeats_of_finished_requests_and_leave_out_the_recovery_run():
    lats = {(x.candidate, x.mix): x for x in pics.latencies(pics.measured_runs(stored_run()))}
    assert set(lats) == {("colocated-chunk-16", "mixed"), ("disaggregated", "mixed")}
    chunk = lats[("colocated-chunk-16", "mixed")]
    assert chunk.ttft_ms == pytest.approx((500.0, 700.0, 1500.0))
    assert chunk.itl_ms == pytest.approx((30.0, 40.0, 50.0, 200.0))
    assert lats[("disaggregated", "mixed")].ttft_ms == pytest.approx((900.0,))   # the failed one has none


def test_a_live_result_reads_like_the_stored_run():
    lc = Lifecycle("r1", arrived_s=1.0, n_prompt_tokens=40)
    lc.advance(RequestState.PREFILLING, 1.1)
    lc.advance(RequestState.DECODING, 1.3)
    for t in (1.3, 1.33, 1.43):
        lc.add_token(t)
    lc.advance(RequestState.FINISHED, 1.43)
    record = RunRecord(mode="colocated", config={}, trace_name="short", summary=summarize([lc], []), stalls=(),
                       worker_events=(), memory=(), kv_arena_bytes=0, energy_j={}, requests=(lc,))
    cands = [Candidate("colocated-chunk-16", Mode.COLOCATED, chunk=16)]
    result = AdviseResult(None, cands, {("colocated-chunk-16", "short", 0): record}, {}, recommend(Evidence(cands)),
                          AdviseSettings(), {}, None, 1.0)
    (run,) = pics.measured_runs(result.run)
    assert run.mode is Mode.COLOCATED and run.mix == "short"
    (lat,) = pics.latencies([run])
    assert lat.ttft_ms == pytest.approx((300.0,)) and lat.itl_ms == pytest.approx((30.0, 100.0))


def test_the_projection_covers_the_disaggregated_runs_only():
    (p,) = pics.run_projections(stored_run())
    assert (p.candidate, p.mix, p.kv_bytes_per_token, p.n_prompts) == ("disaggregated", "mixed", 30_000, 1)
    assert p.measured_handoff_ms_p50 == pytest.approx(4.0)
    assert [link.link_gbit_s for link in p.links] == [1.0, 2.5, 10.0]


def test_cdf_is_thinned_with_both_ends_kept():
    xs, ys = pics.cdf(tuple(float(i) for i in range(1000)), max_points=50)
    assert len(xs) == 50 and (xs[0], xs[-1], ys[-1]) == (0.0, 999.0, 1.0)
    assert pics.cdf(()) == ([], [])


def test_the_image_files_are_a_valid_svg_and_png_naming_every_series(tmp_path):
    from homepd.advise.report.figure import write

    p = pics.run_pictures(stored_run([curve("colocated-chunk-16", "mixed", 0.4), curve("disaggregated", "mixed", 0.2)]))
    svg, png = write(p, tmp_path / "advise-12", ttft_budget_ms=4000.0, itl_budget_ms=100.0)
    assert (svg.name, png.name) == ("advise-12.svg", "advise-12.png")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["advise-12.png", "advise-12.svg"]   # no temp file left
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for name in ("colocated-chunk-16: 0.40 ± 0.05 req/s", "disaggregated: 0.20 ± 0.05 req/s", "target 90%",
                 "budget 4000 ms", "budget 100 ms", "capacity · mixed mix", "advise run 12"):
        assert name in texts, name
    assert "projected, not measured" in texts
    ids = {g.get("id") for g in root.iter("{http://www.w3.org/2000/svg}g")}
    assert {"capacity:disaggregated:mixed", "ttft_ms:colocated-chunk-16:mixed", "itl_ms:disaggregated:mixed"} <= ids
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width == 1600 and height > 400


def test_a_run_without_capacity_or_latencies_still_draws(tmp_path):
    from homepd.advise.report.figure import write

    (svg,) = write(pics.Pictures("old run", (), (), ()), tmp_path / "old", png=False)
    texts = " ".join(t.text or "" for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text"))
    assert "no capacity search in this run" in texts and "no latencies recorded" in texts


def test_stored_probes_reduce_to_the_probe_at_capacity_or_the_lowest_when_none_passed():
    def result(cand, mix, ttft_s):
        return {"candidate": cand, "mix": mix, "status": "measured", "mode": "colocated",
                "record": {"mode": "colocated", "requests": [request(ttft_s, [0.03])]}}
    run = {"id": 3, "kind": "advise", "status": "complete",
           "results": [result("a", "mixed@0.2/s", 0.1), result("a", "mixed@0.4/s", 0.4),
                       result("a", "mixed@0.8/s", 9.0),
                       result("b", "mixed@0.3/s", 5.0), result("b", "mixed@0.15/s", 6.0),   # no capacity: lowest
                       result("c", "short", 0.2)],                                             # not a probe
           "recommendations": [{"data": {"capacity": [curve("a", "mixed", 0.4), curve("b", "mixed", None)]}}]}
    lats = {(x.candidate, x.mix): x.ttft_ms for x in pics.latencies(pics.measured_runs(decode_run(run)))}
    assert lats == {("a", "mixed"): pytest.approx((400.0,)), ("b", "mixed"): pytest.approx((6000.0,)),
                    ("c", "short"): pytest.approx((200.0,))}
    assert pics.split_probe("mixed@0.333/s") == ("mixed", 0.333) and pics.split_probe("mixed+kill") == ("mixed+kill", None)


def twin(candidate: str, capacity: float, checks=((0.4, 1.0, 0.85),)) -> dict:
    """A ``TwinEvidence`` as ``to_plain`` writes it: its capacity on the mixed trace and its checks there."""
    from homepd.twin.calibration import Calibration
    from homepd.twin.records import TwinCapacity, TwinCheck, TwinEvidence, TwinPoint

    points = tuple(TwinPoint(r, a, (a - 0.05, a, a + 0.02, a), 200.0, 900.0, 80.0)
                   for r, a in ((0.2, 0.99), (0.4, 0.93), (0.8, 0.4)))
    cap = TwinCapacity(candidate, "mixed", 0.9, capacity, (capacity * 0.9, capacity * 1.1), (capacity,) * 20,
                       points + (TwinPoint(0.5, 0.1, (0.1,), 200.0, 900.0, 80.0),), 20, 200, 0.02, 1.0, 600.0, 1.0, "every gap")
    found = tuple(TwinCheck(r, 1000, 16, m, 200.0, 900.0, 80.0, p, 190.0, 950.0, 85.0, mix="mixed")
                  for r, m, p in checks)
    return to_plain(TwinEvidence(candidate, Calibration(candidate, ()), (cap,), found, trusted=True,
                                 why="checked", attainment_error_points=15.0))


def test_a_twin_is_drawn_as_its_curve_band_interval_and_checks(tmp_path):
    from homepd.advise.report.figure import write

    data = stored_dict([curve("colocated-chunk-16", "mixed", 0.4, rates=(0.4,))])
    data["recommendations"][0]["data"]["twins"] = [twin("colocated-chunk-16", 0.4)]
    data["results"].append({"candidate": "colocated-chunk-16", "mix": "calibration", "status": "measured",
                            "mode": "colocated", "record": {"mode": "colocated", "requests": [request(5.0, [])]}})
    p = pics.run_pictures(decode_run(data))
    (t,) = p.twins
    # the rate only one seed ran is left out; the band is the seeds' 10th to 90th percentile
    assert [x[0] for x in t.points] == [0.2, 0.4, 0.8]
    assert t.points[0][2] < t.points[0][1] <= t.points[0][3]
    assert t.checks == ((0.4, 1.0, 0.85),)
    assert p.mixes == ("mixed",)            # the calibration burst is not a mix of the traffic
    (svg,) = write(p, tmp_path / "twin", png=False, ttft_budget_ms=4000.0, itl_budget_ms=100.0)
    root = ET.parse(svg).getroot()
    texts = " ".join(x.text or "" for x in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "colocated-chunk-16 twin: 0.40 [0.36-0.44] req/s, off 15 pts" in texts
    assert "-15 pts" in texts and "measured check" in texts
    ids = {g.get("id") for g in root.iter("{http://www.w3.org/2000/svg}g")}
    assert {"twin:colocated-chunk-16:mixed", "twin-band:colocated-chunk-16:mixed",
            "twin-interval:colocated-chunk-16:mixed", "check:colocated-chunk-16:mixed"} <= ids
    assert "capacity:colocated-chunk-16:mixed" not in ids   # its probes are the twin's checks


def test_the_twins_report_says_per_mix_whose_capacity_the_answer_is():
    import types

    from homepd.advise.report.render import render_twins
    from homepd.measure.curve import CapacityCurve
    from homepd.twin.records import TwinEvidence
    from homepd.store.records import decode_advice

    data = twin("colocated-adaptive", 1.3)
    evidence = decode_advice({"twins": [data]}).twins[0]
    assert isinstance(evidence, TwinEvidence)
    for source, says in (("twin", "the answer on this mix: the twin's (its checks here confirmed it)"),
                         ("measured", "the answer on this mix: the measured probes' (its checks here did not "
                                      "confirm the twin)")):
        curve = CapacityCurve("colocated-adaptive", "mixed", 0.9, 0.1, (), 1.3, None, "x", source=source)
        result = types.SimpleNamespace(twins={"colocated-adaptive": evidence},
                                       capacity={("colocated-adaptive", "mixed"): curve})
        assert says in render_twins(result)
