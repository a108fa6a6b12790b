"""A stored run decoded once into typed records (``homepd.store.records``): a run written by today's writer code
(the store's row functions, the campaign's recommendation data) reads back whole; a row older than a field
gets its default; a corrupt row is an error naming the field; a live result reads as the same ``Run``."""
from __future__ import annotations

import json

import pytest

from homepd.advise.campaign.recommend import Evidence, recommend
from homepd.advise.campaign.run import AdviseResult, AdviseSettings, advice_data, measurement
from homepd.config import EngineConfig
from homepd.core.terms import RequestClass
from homepd.core.lifecycle import RequestState
from homepd.core.modes import Mode
from homepd.core.records import RecordShapeError, to_plain
from homepd.measure.metrics import SLO
from homepd.store import Store
from homepd.store.records import RequestTimeline, Run, decode_run
from live_evidence import CO, DI, candidates, curve, record

SLO_USED = SLO(ttft_ms=3000.0, itl_ms=150.0)


def campaign_parts():
    """What a quick campaign ends with: candidates (one infeasible), the records at each capacity, the curves
    and the recommendation, as ``homepd.advise.campaign.run`` makes them."""
    cands = candidates()
    cands[-1] = type(cands[-1])(cands[-1].name, cands[-1].mode, feasible=False, reason="not enough memory")
    records = {(CO, "mixed", 0): record("mixed", 40, RequestClass.INTERACTIVE, 6),
               (DI, "mixed", 0): record("mixed", 900, RequestClass.BACKGROUND, 4)}
    capacity = {(CO, "mixed"): curve(CO, "mixed", 1.0, 0.19), (DI, "mixed"): curve(DI, "mixed", 0.5, 0.1)}
    evidence = Evidence(list(cands), capacity=dict(capacity), not_exercised={(DI, "mixed"): "no prompt handed off"})
    for (name, mix, _), rec in records.items():
        evidence.add(name, mix, measurement(rec))
    return cands, records, capacity, evidence, recommend(evidence)


def write_today(db) -> int:
    """An advise run written as ``Campaign.run`` writes one (begin, infeasible, probes, recommendation)."""
    cands, records, capacity, evidence, rec = campaign_parts()
    base, settings = EngineConfig(backend="fake", n_ctx=2048, n_threads=2), AdviseSettings(slo=SLO_USED, seed=3)
    with Store.open(db) as store:
        run = store.begin_run("advise", {"base": to_plain(base), "settings": to_plain(settings)},
                              hardware={"cpu": {"physical_cores": 2, "model": "a CPU"}}, trace={"mixes": ["mixed"]})
        for c in cands:
            if not c.feasible:
                store.add_infeasible(run, c.name, c.reason)
        for (name, mix, repeat), record_ in records.items():
            store.add_result(run, name, f"{mix}@1/s", repeat, record_)
        store.add_recommendation(run, advice_data(rec, capacity, cands, evidence.not_exercised), headline="h")
        store.finish_run(run)
    return run


def test_a_run_written_by_todays_writer_decodes_whole(tmp_path):
    run_id = write_today(tmp_path / "runs.db")
    with Store.open(tmp_path / "runs.db") as store:
        run = store.load_run(run_id)
    assert isinstance(run, Run) and (run.id, run.kind, run.status, run.headline) == (run_id, "advise", "complete", "h")
    assert (run.config.n_ctx, run.config.n_threads, run.config.seed, run.config.slo) == (2048, 2, 3, SLO_USED)
    assert run.config.budgets_ms == (3000.0, 150.0) and run.n_physical_cores == 2
    infeasible, co, di = run.probes
    assert (infeasible.status, infeasible.reason, infeasible.is_measured) == ("infeasible", "not enough memory", False)
    assert (co.candidate, co.mix, co.repeat, co.architecture, co.n_requests) == (CO, "mixed@1/s", 0, Mode.COLOCATED, 10)
    assert co.goodput_per_s is not None and co.ttft_p99_ms is not None
    req = di.requests[0]
    assert isinstance(req, RequestTimeline) and req.timings.state is RequestState.FINISHED
    assert req.timings.request_class is RequestClass.BACKGROUND and req.timings.n_prompt_tokens == 900
    assert len(req.token_times_s) == 4 and req.routed_to is None
    advice = run.advice
    assert advice.candidate.name == CO and advice.rule and advice.confidence in ("high", "medium", "low")
    assert [c.name for c in advice.candidates] == [c.name for c in candidates()]
    assert advice.curve(CO).capacity_rps == 1.0 and advice.curve(DI).probes[1].misses == {"every gap <= 100 ms": 5}
    assert not advice.is_exercised(DI, "mixed") and advice.is_exercised(CO, "mixed")
    assert [p.mix for p in advice.per_mix] == ["mixed"]


def test_rows_older_than_a_field_get_its_default(tmp_path):
    run_id = write_today(tmp_path / "runs.db")
    with Store.open(tmp_path / "runs.db") as store:
        # what older homepd versions wrote: no routing, no cached tokens, no class; no candidate list, no curves'
        # misses; an SLO whose per-token target was called tpot_ms
        store.db.execute("UPDATE requests SET lifecycle_json = json_remove(lifecycle_json, '$.routed_to', "
                         "'$.n_cached_tokens', '$.request_class', '$.ttfa_s', '$.kv_slot_wait_s', "
                         "'$.kv_extent_wait_s')")
        store.db.execute("UPDATE recommendations SET data_json = json_remove(data_json, '$.candidates', "
                         "'$.not_exercised', '$.capacity[1].probes[1].misses')")
        config = json.loads(store.db.execute("SELECT config_json FROM runs").fetchone()[0])
        config["settings"]["slo"]["tpot_ms"] = config["settings"]["slo"].pop("itl_ms")
        store.db.execute("UPDATE runs SET config_json = ?", [json.dumps(config)])
        run = store.load_run(run_id)
    req = run.probes[2].requests[0]
    assert (req.routed_to, req.timings.n_cached_tokens, req.timings.ttfa_s) == (None, 0, None)
    assert req.timings.request_class is RequestClass.INTERACTIVE
    assert [c.name for c in run.advice.candidates] == [CO] and run.advice.not_exercised == ()
    assert run.advice.curve(DI).probes[1].misses == {}
    assert run.config.slo.itl_ms == 150.0


def test_a_row_from_before_the_extent_rename_reads_its_old_field_name(tmp_path):
    run_id = write_today(tmp_path / "runs.db")
    with Store.open(tmp_path / "runs.db") as store:
        # what homepd wrote while the arena's extents were called slots: kv_slot_wait_s only
        store.db.execute("UPDATE requests SET lifecycle_json = json_set(json_remove(lifecycle_json, "
                         "'$.kv_extent_wait_s'), '$.kv_slot_wait_s', 0.25)")
        run = store.load_run(run_id)
        lifecycle = json.loads(store.db.execute("SELECT lifecycle_json FROM requests").fetchone()[0])
    assert run.probes[2].requests[0].timings.kv_extent_wait_s == 0.25 and "kv_extent_wait_s" not in lifecycle


def test_a_corrupt_row_is_an_error_naming_its_field(tmp_path):
    run_id = write_today(tmp_path / "runs.db")
    with Store.open(tmp_path / "runs.db") as store:
        store.db.execute("UPDATE requests SET lifecycle_json = json_remove(lifecycle_json, '$.state') WHERE id = 1")
        with pytest.raises(RecordShapeError, match=r"results\[1\].*requests\[0\].*timings.*missing field\(s\) state"):
            store.load_run(run_id)
        store.db.execute("UPDATE requests SET lifecycle_json = json_set(lifecycle_json, '$.state', 'finished')")
        store.db.execute("UPDATE recommendations SET data_json = json_set(data_json, '$.capacity[0].capacity_rps', "
                         "'fast')")
        with pytest.raises(RecordShapeError, match=r"capacity\[0\]\.capacity_rps: expected int or float"):
            store.load_run(run_id)


def test_a_live_result_is_the_same_run_as_its_stored_twin(tmp_path):
    cands, records, capacity, evidence, rec = campaign_parts()
    base, settings = EngineConfig(backend="fake", n_ctx=2048, n_threads=2), AdviseSettings(slo=SLO_USED, seed=3)
    live = AdviseResult(7, cands, records, {}, rec, settings, {"cpu": {"physical_cores": 2}}, None, 1.0,
                        capacity, (None, None), base, evidence.not_exercised).run
    run_id = write_today(tmp_path / "runs.db")
    with Store.open(tmp_path / "runs.db") as store:
        stored = decode_run({**store.get_run(run_id), "id": 7})
    assert live.config == stored.config and live.advice == stored.advice
    # the live result keeps the probe at each capacity under the plain mix; the store every probe at its rate
    assert [(p.candidate, p.mix) for p in live.measured] == [(p.candidate, p.mix.split("@")[0]) for p in stored.measured]
    assert [p.requests for p in live.measured] == [p.requests for p in stored.measured]
