"""The app's view records, derived from engine, measurement, advise and store data (pure, no Textual app)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from homepd.core.protocol import StepRecord
from homepd.core.lifecycle import Lifecycle, RequestState, RequestTimings
from homepd.core.records import EngineSnapshot, KVArenaSnapshot, WorkerEvent, WorkerEventKind, WorkerSnapshot
from homepd.measure.stalls import Culprit, Stall
from homepd.measure.stepstream import StepSample
from homepd.tui import derive
from homepd.tui.widgets.text import cores_text
from homepd.store.records import decode_advice, decode_run
from homepd.tui.evidence import from_stored_run, recommendation_view, step_from_progress
from homepd.tui.state import AppState, ChatTurn


def worker(role: str, pid: int, cores, in_flight=()) -> WorkerSnapshot:
    return WorkerSnapshot(role, pid, True, True, 0, 1, cores, "", 0, tuple(in_flight), 0)


def figures(**kw) -> RequestTimings:
    """A finished request's figures: a fresh lifecycle's, with ``kw`` replaced."""
    return replace(Lifecycle("r", 0.0).timings(), **kw)


def test_cores_are_written_as_ranges():
    assert cores_text((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert cores_text(None) == ""


def test_architecture_view_reads_the_engine_snapshot():
    snap = EngineSnapshot(
        mode="disaggregated", model="/m/smollm2.gguf", n_ctx=512, chunk=256,
        workers=(worker("prefill", 10, (0,), ["a"]), worker("decode", 11, (1,), ["b", "c"])),
        kv_arena=KVArenaSnapshot(1 << 20, 4, {"FREE": 0, "WRITING": 1, "READY": 1, "READING": 0}, ("a", "b"),
                                 used_bytes=3 * 4096),
        requests={"waiting": ("x",), "prefilling": ("a",), "decoding": ("b", "c")}, n_steps=9,
        worker_events=(WorkerEvent(WorkerEventKind.RESTARTED, "decode", 11, 1.0, recovery_s=1.25),))
    view = derive.architecture_view(snap, kv_mb_s=2.5)
    assert (view.mode, view.model, view.n_waiting, view.n_running) == ("disaggregated", "smollm2.gguf", 1, 3)
    assert [(w.role, cores_text(w.cpu_cores), len(w.in_flight)) for w in view.workers] == [("prefill", "0", 1),
                                                                                           ("decode", "1", 2)]
    arena = view.kv_arena
    assert (arena.n_extents, arena.extents["WRITING"], arena.max_extents, view.kv_mb_s) == (2, 1, 4, 2.5)
    assert (arena.used_bytes, arena.capacity_bytes) == (3 * 4096, 1 << 20) and "FREE" not in arena.extents
    assert view.events == ("decode worker restarted after 1.2 s",)


def test_the_architecture_panel_says_when_the_kv_cache_is_split_in_streams():
    from homepd.tui.widgets.architecture import render_architecture

    snap = EngineSnapshot(mode="colocated", model="m.gguf", n_ctx=8192, chunk=256,
                          workers=(worker("colocated", 10, None),), kv_arena=None, requests={}, n_steps=0,
                          worker_events=(), kv_stream_cells=2048)
    head = render_architecture(derive.architecture_view(snap)).plain.splitlines()[0]
    assert head.endswith("n_ctx 8192 in streams of 2048")
    pooled = render_architecture(derive.architecture_view(replace(snap, kv_stream_cells=None))).plain
    assert pooled.splitlines()[0].endswith("n_ctx 8192") and "streams" not in pooled
    # one sequence id: its "stream" is the whole cache, so nothing is said of streams
    single = render_architecture(derive.architecture_view(replace(snap, kv_stream_cells=8192))).plain
    assert single.splitlines()[0].endswith("n_ctx 8192") and "streams" not in single
    assert EngineSnapshot.from_dict(snap.to_dict()) == snap  # /status carries it to an attached app


def test_a_stall_names_the_prompt_that_held_it_longest():
    stall = Stall("req-2", 5, 412.0, (Culprit("req-7", 256, 380.0, True), Culprit("req-8", 32, 20.0, True)))
    assert derive.stall_text(stall) == "412 ms ← req-7 (256 tok, same step) +1"
    assert derive.stall_text(Stall("r", 1, 150.0, (Culprit("p", 64, 90.0, False),))) == \
        "150 ms ← p (64 tok, beside)"
    assert derive.stall_text(None) == ""


def test_a_chart_point_takes_the_tick_s_requests_and_steps():
    steps = [StepRecord("colocated", 0, 0.0, 0.030, ("a",), ()),
             StepRecord("colocated", 1, 0.030, 0.250, ("a",), (("b", 256),)),
             StepRecord("colocated", 2, 0.250, 0.280, ("a", "b"), ())]
    finished = [figures(ttft_s=0.25, tpot_s=0.03, n_output_tokens=3), figures(ttft_s=0.1, n_output_tokens=0)]
    point = derive.chart_point(5.0, 0.5, finished, StepSample.of(steps, 5.0), steps)
    assert point.ttft_ms == 250.0 and point.tpot_ms == 30.0
    assert round(point.itl_ms) == 220 and point.tok_s == 8.0        # 4 decode tokens in 0.5 s
    assert point.interference is not None and point.interference > 5  # the chunked step vs the lone ones
    remote = derive.chart_point(5.0, 0.5, finished)                 # no step log: tokens of finished requests
    assert remote.itl_ms is None and remote.tok_s == 6.0 and remote.interference is None


def test_hardware_view_says_plainly_that_there_is_no_gpu():
    snap = SimpleNamespace(gpus=(), processes=(), ram_used_bytes=1 << 30, ram_available_bytes=3 << 30, cpu_pct=12.5)
    box = SimpleNamespace(gpus=(), nvml=SimpleNamespace(error="NVML Shared Library Not Found"),
                          cpu=SimpleNamespace(model="Celeron N3450", usable_cpus=(0, 1, 2, 3)))
    view = derive.hardware_view(snap, box)
    assert view.gpu_note == "no GPU on this box (NVML Shared Library Not Found)"
    assert (view.n_cpus, view.ram_total_bytes, view.cpu_pct) == (4, 4 << 30, 12.5)


def test_chat_stats_come_from_the_request_s_timings():
    lc = Lifecycle("r", arrived_s=1.0, n_prompt_tokens=30)
    lc.advance(RequestState.PREFILLING, 1.0)
    lc.advance(RequestState.TRANSFERRING, 1.1)
    lc.transfer_end_s, lc.kv_bytes = 1.105, 1000
    lc.advance(RequestState.DECODING, 1.105)
    for t in (1.2, 1.24, 1.28):
        lc.add_token(t)
    stats = derive.chat_stats(lc.timings(), "disaggregated", "stop")
    assert (stats.ttft_ms, stats.tpot_ms, stats.kv_bytes, stats.n_output_tokens) == \
        (pytest.approx(200.0), pytest.approx(40.0), 1000, 3)
    assert stats.kv_transfer_ms == pytest.approx(5.0)
    nothing = derive.chat_stats(None, "colocated", None, "worker died")
    assert (nothing.mode, nothing.ttft_ms, nothing.error) == ("colocated", None, "worker died")


def test_advise_progress_carries_the_candidate_the_campaign_names():
    import time

    from homepd.advise.campaign.run import AdviseSettings, Campaign
    from homepd.config import EngineConfig

    seen = []
    campaign = Campaign(EngineConfig(backend="fake"), AdviseSettings(wall_budget_s=None), on_progress=seen.append)
    campaign._t0 = time.monotonic()
    campaign._report("colocated-chunk-64 on the long trace at 0.5 req/s (repeat 1/2)", "colocated-chunk-64")
    campaign._report("recovery: disaggregated, a worker killed mid-run", "disaggregated")
    for twin_step in ("colocated-adaptive: the twin on the mixed trace (20 seeds x 200 requests)",
                      "colocated-adaptive: calibration burst", "colocated-adaptive: checked at 0.9 req/s"):
        campaign._report(twin_step, "colocated-adaptive")
    campaign._report("calibration: prefill and decode speeds")   # the box's speeds, before any candidate
    steps = [step_from_progress(p) for p in seen]
    assert [s.candidate for s in steps] == ["colocated-chunk-64", "disaggregated", *["colocated-adaptive"] * 3, None]
    assert steps[2].current.startswith("colocated-adaptive: the twin on the mixed trace")


def test_a_twin_candidate_counts_its_steps_done_whatever_their_words():
    state = AppState()
    for done, text in ((0, "a: calibration burst"), (1, "a: calibrated"), (1, "a: the twin on the mixed trace"),
                       (2, "a: the twin done"), (2, "a: checking the twin at 1 req/s (mixed)"),
                       (3, "a: checked at 1 req/s"), (3, "b: calibration burst")):
        state.add_advise_step(step_from_progress(SimpleNamespace(done=done, total=6, current=text, elapsed_s=1.0,
                                                                 eta_s=None, candidate=text.split(":")[0])))
    assert state.advise_candidates == {"a": 3, "b": 0}


def test_a_stored_run_becomes_evidence_rows_per_candidate_and_mix():
    def result(cand, mix, goodput, **kw):
        return {"candidate": cand, "mix": mix, "status": "measured", "goodput_per_s": goodput,
                "ttft_p99_ms": 900.0, "itl_p99_ms": 40.0, "total_pss_bytes": 200 << 20,
                "record": {"summary": {"kv": None}}, **kw}
    run = {"id": 3, "kind": "advise", "status": "complete", "started_at": "2026-01-01T10:00:00",
           "results": [result("colocated-chunk-256", "short", 1.0), result("colocated-chunk-256", "short", 2.0),
                       result("disaggregated", "short", 0.5,
                              record={"summary": {"kv": {"transfer_ms": {"p50": 12.0}}}}),
                       {"candidate": "replicas-2", "mix": None, "status": "infeasible", "reason": "one GPU"}],
           "recommendations": [{"headline": "x", "data": {
               "candidate": {"name": "colocated-chunk-256", "mode": "colocated"}, "config": {"mode": "colocated", "chunk": 256},
               "rule": "best goodput", "reason": "because", "confidence": "high", "confidence_why": "2 repeats",
               "per_mix": [{"mix": "short", "candidate": "colocated-chunk-256", "rule": "r"}]}}]}
    view = from_stored_run(decode_run(run))
    rows = {(r.candidate, r.mix): r for r in view.rows}
    assert rows[("colocated-chunk-256", "short")].goodput_per_s == 1.5
    assert rows[("colocated-chunk-256", "short")].n_repeats == 2
    assert rows[("disaggregated", "short")].kv_transfer_ms == 12.0
    assert rows[("replicas-2", "-")].infeasible == "one GPU"
    assert view.mixes == ("short",) and view.recommendation.config == {"mode": "colocated", "chunk": 256}
    assert recommendation_view(decode_advice({"headline": "no rule here"})) is None


def test_the_conversation_leaves_out_failed_and_unfinished_turns():
    state = AppState(turns=[ChatTurn("a", "b", stats=object()), ChatTurn("c", error="engine stopped"),
                            ChatTurn("d", "partial")])
    assert state.chat_messages() == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
