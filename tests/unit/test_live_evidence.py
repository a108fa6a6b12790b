"""The evidence live advice reads from the store (``homepd.advise.live.evidence``): the latest advise run of the
served model, its curves as rows, the candidates' configurations and each mix's request shape measured from
its probes; and the traffic table keeping each request's SLO verdict for a restarted profile."""
from __future__ import annotations

from homepd.advise.live.evidence import load_live_evidence
from homepd.hw.probe import BoxIdentity
from homepd.core.terms import RequestClass
from homepd.core.modes import Mode
from homepd.measure.trace.traffic import RecordedRequest
from homepd.store import Store
from homepd.store.traffic import add_traffic, traffic_since

from live_evidence import CO, DI, store_evidence

I, B = RequestClass.INTERACTIVE, RequestClass.BACKGROUND


def test_the_latest_run_of_the_served_model_with_its_rows_shapes_and_configurations(tmp_path):
    db = tmp_path / "runs.db"
    mine = store_evidence(db, {"short": (40, I, 8), "long": (620, B, 16)},
                          {(CO, "short"): (8.0, 1.0), (DI, "long"): (3.0, 0.5)})
    store_evidence(db, {"short": (40, I, 8)}, {(CO, "short"): (9.0, 1.0)}, model="another.gguf")
    with Store.open(db) as store:
        ev = load_live_evidence(store, "smollm2-135m-instruct-q4_1")
        assert load_live_evidence(store, "nothing-measured.gguf") is None
    assert ev.run_id == mine
    assert [(r.candidate, r.mix, r.capacity_rps, r.spread_rps, r.max_probed_rps) for r in ev.rows] == [
        (CO, "short", 8.0, 1.0, 9.0), (DI, "long", 3.0, 0.5, 3.5)]
    short, long_ = ev.shapes["short"], ev.shapes["long"]
    assert (short.n_requests, short.long_share, short.background_share, short.prompt_tokens_p50,
            short.mean_output_tokens) == (10, 0.0, 0.0, 40, 8)
    assert (long_.long_share, long_.background_share, long_.prompt_tokens_p90, long_.mean_output_tokens) == \
        (1.0, 1.0, 620, 16)
    assert ev.configs[DI]["mode"] is Mode.DISAGGREGATED and ev.configs[DI]["local_prefill"] is True
    assert ev.configs[CO]["adaptive_chunk"] is True
    # a re-read finds no newer run: the evidence already held is kept; a newer run replaces it
    with Store.open(db) as store:
        assert load_live_evidence(store, "smollm2-135m-instruct-q4_1", ev) is ev
    newer = store_evidence(db, {"short": (40, I, 8)}, {(CO, "short"): (7.0, 1.0)})
    with Store.open(db) as store:
        again = load_live_evidence(store, "smollm2-135m-instruct-q4_1", ev)
    assert again.run_id == newer != mine and again.rows[0].capacity_rps == 7.0


def probed(cpu: str, n_cpus: int, *gpus: str) -> dict:
    """A stored probe's JSON form, as much of it as the box's identity reads."""
    return {"cpu": {"model": cpu, "usable_cpus": list(range(n_cpus))}, "gpus": [{"name": g} for g in gpus],
            "memory": {"ram_available_bytes": 12345}}


def test_evidence_measured_on_another_box_is_not_read_as_this_one_s(tmp_path):
    db = tmp_path / "runs.db"
    epyc, xeon = probed("AMD EPYC", 2), probed("Intel Xeon", 2)
    on_epyc = store_evidence(db, {"short": (40, I, 8)}, {(CO, "short"): (8.0, 1.0)}, hardware=epyc)
    on_xeon = store_evidence(db, {"short": (40, I, 8)}, {(CO, "short"): (5.0, 1.0)}, hardware=xeon)
    m = "smollm2-135m-instruct-q4_1"
    with Store.open(db) as store:
        here = load_live_evidence(store, m, box=BoxIdentity.of({**epyc, "memory": {"ram_available_bytes": 1}}))
        newest = load_live_evidence(store, m, box=BoxIdentity.of(xeon))
        anywhere = load_live_evidence(store, m)
        gpu_box = BoxIdentity.of(probed("AMD EPYC", 2, "NVIDIA GeForce RTX 3060"))
        elsewhere = load_live_evidence(store, m, box=gpu_box)
    # the newest run of this box, not the newest run: free memory is not what makes a box another one
    assert (here.run_id, here.rows[0].capacity_rps, here.measured_on) == (on_epyc, 8.0, "AMD EPYC (2 CPUs), no GPU")
    assert newest.run_id == anywhere.run_id == on_xeon
    # a GPU added: no run holds, and the verdict says why instead of reading another box's capacities
    assert elsewhere.rows == () and elsewhere.run_id == on_xeon
    assert "another box" in elsewhere.foreign and "Intel Xeon (2 CPUs), no GPU" in elsewhere.foreign \
        and "NVIDIA GeForce RTX 3060" in elsewhere.foreign


def test_the_traffic_table_keeps_each_requests_slo_verdict(tmp_path):
    with Store.open(tmp_path / "t.db") as store:
        add_traffic(store, [RecordedRequest("a", 1.0, 40, 8, slo_met=True), RecordedRequest("b", 2.0, 40, 8,
                                                                                             slo_met=False),
                            RecordedRequest("c", 3.0, 40, 8)])
        assert [r.slo_met for r in traffic_since(store, 0)] == [True, False, None]


def test_a_run_without_capacity_curves_gives_no_evidence(tmp_path):
    with Store.open(tmp_path / "e.db") as store:
        run = store.begin_run("advise", {"base": {"model": "m"}})
        store.add_recommendation(run, {"headline": "old run without curves"})
        store.finish_run(run)
        assert load_live_evidence(store, "m") is None


def test_a_restarted_service_rebuilds_its_profile_and_verdicts_from_the_store(tmp_path):
    import types

    from homepd.config import EngineConfig
    from homepd.config.origin import ConfigOrigin, ConfigSource
    from homepd.serve.advice import LiveAdvisor
    from homepd.serve.settings import ServeSettings

    db = tmp_path / "runs.db"
    store_evidence(db, {"short": (54, I, 8)}, {(CO, "short"): (8.0, 1.0), (DI, "short"): (4.0, 1.0)})
    now = 1_000_000.0
    with Store.open(db) as store:  # what the service before the restart recorded: 12 chats, 3 of them late
        add_traffic(store, [RecordedRequest(f"r{i}", now - 60 + i, 54, 8, slo_met=i % 4 != 0) for i in range(12)]
                    + [RecordedRequest("old", now - 7200, 54, 8, slo_met=True)])
    published = []
    service = types.SimpleNamespace(
        settings=ServeSettings(db=str(db), advice_windows_s=(300.0, 3600.0), advice_min_requests=4),
        config=EngineConfig(backend="fake"), engine=None, state="ready",
        origin=ConfigOrigin(ConfigSource.DEFAULT, "colocated", "built-in default"),
        publish=lambda kind, data: published.append((kind, data)))
    advisor = LiveAdvisor(service, clock=lambda: now)
    advisor.load()
    state = advisor.to_dict()
    assert advisor.n_restored == 12 and state["running"] == CO and state["evidence"]["run_id"] is not None
    five = state["profile"][0]
    assert five["n_requests"] == 12 and five["slo_attainment"] == {"interactive": 0.75}
    assert advisor.evaluate().kind.value == "keep" and published == []
