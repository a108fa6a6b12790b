"""``homepd advise export``: a constructed stored recommendation mapped to llama-server, vLLM, SGLang and llm-d
settings (checked flag by flag, and the recipe files against golden files: they are configuration), the
routing threshold, the two-box answer, the trace and benchmark, and the command on a real store."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from homepd.advise.export.plan import ExportEngine, plan_from_run, route_threshold
from homepd.advise.export.recipes import recipe
from homepd.advise.export.documents import bench_commands, export_files, two_box_answer
from homepd.advise.report.twobox import LinkProjection, TwoBoxProjection
from homepd.core.modes import Mode
from homepd.errors import ConfigError
from homepd.main import main
from homepd.store import Store
from homepd.store.records import Run, decode_run

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "export"
CANDIDATES = [
    {"name": "colocated-unchunked", "mode": "colocated", "chunk": None},
    {"name": "colocated-chunk-32", "mode": "colocated", "chunk": 32},
    {"name": "disaggregated-routed", "mode": "disaggregated", "chunk": 256, "adaptive_chunk": True,
     "local_prefill": True},
    {"name": "replicas-2", "mode": "replicas", "chunk": 128, "n_replicas": 2},
]


def request(routed_to: str, n_prompt: int, n_cached: int = 0) -> dict:
    """A stored request timeline (the fields a stored one always has, and those the export reads)."""
    return {"request_id": f"r{n_prompt}", "routed_to": routed_to, "n_prompt_tokens": n_prompt,
            "n_cached_tokens": n_cached, "state": "finished", "n_output_tokens": 4, "ttft_s": 0.5, "tpot_s": 0.05}


def stored_run(recommended: str = "colocated-chunk-32", requests=None) -> Run:
    return decode_run(stored_dict(recommended, requests))


def stored_dict(recommended: str = "colocated-chunk-32", requests=None) -> dict:
    """A stored advise run as ``Store.get_run`` returns it (the fields the export reads)."""
    requests = requests if requests is not None else [request("decode", 40), request("decode", 90, 30),
                                                      request("prefill", 200), request("prefill", 530)]
    rec = {"candidate": next(c for c in CANDIDATES if c["name"] == recommended), "candidates": CANDIDATES,
           "capacity": [{"candidate": c["name"], "mix": "mixed", "capacity_rps": 0.84, "spread_rps": 0.16,
                         "target_share": 0.9, "resolution_rps": 0.16, "probes": [], "decided_by": ""}
                        for c in CANDIDATES]}
    return {"id": 7, "kind": "advise", "status": "complete",
            "config": {"base": {"n_ctx": 8192, "n_seq_max": 4, "n_threads": 4, "model": "smollm2-135m-instruct-q4_1",
                                "prefix_cache": True},
                       "settings": {"slo": {"ttft_ms": 4000, "itl_ms": 100, "token_target": "gap"},
                                    "max_tokens": 32, "long_tokens": 400, "seed": 0}},
            "hardware": {"cpu": {"physical_cores": 2}},
            "results": [{"candidate": "disaggregated-routed", "mix": "mixed@0.84/s", "status": "measured",
                         "mode": "disaggregated", "record": {"mode": "disaggregated", "requests": requests}}],
            "recommendations": [{"data": rec}]}


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HOMEPD_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file (HOMEPD_UPDATE_GOLDEN=1 rewrites it)"


def test_the_plan_is_the_recommended_candidate_with_the_campaign_s_configuration_and_slo():
    plan = plan_from_run(stored_run())
    assert (plan.candidate, plan.mode, plan.chunk, plan.n_seq_max, plan.n_ctx) == \
           ("colocated-chunk-32", Mode.COLOCATED, 32, 4, 8192)
    assert (plan.capacity_rps, plan.capacity_mix, plan.ttft_ms, plan.itl_ms) == (0.84, "mixed", 4000, 100)
    assert plan.route_threshold_tokens is None
    other = plan_from_run(stored_run(), "replicas-2")
    assert (other.mode, other.n_replicas) == (Mode.REPLICAS, 2)
    with pytest.raises(ConfigError, match="no candidate 'nope'.*colocated-chunk-32"):
        plan_from_run(stored_run(), "nope")
    with pytest.raises(ConfigError, match="no advise recommendation"):
        plan_from_run(decode_run({**stored_dict(), "kind": "bench-slo"}))


def test_the_routing_threshold_lies_between_the_longest_prompt_kept_local_and_the_shortest_sent_to_prefill():
    # uncached tokens: local 40 and 60 (90 - 30 cached), remote 200 and 530
    assert route_threshold(stored_run(), "disaggregated-routed")[0] == (60 + 200) // 2
    only_remote = stored_run(requests=[request("prefill", 120), request("prefill", 300)])
    assert route_threshold(only_remote, "disaggregated-routed")[0] == 0
    overlap = stored_run(requests=[request("decode", 300), request("prefill", 100)])
    threshold, why = route_threshold(overlap, "disaggregated-routed")
    assert threshold == 200 and "either way" in why
    assert route_threshold(stored_run(requests=[]), "disaggregated-routed")[0] is None


def test_llama_server_gets_the_chunk_as_its_batch_and_the_plan_s_slots_context_threads_and_cache():
    files = recipe(plan_from_run(stored_run()), "llama-server").files
    line = files["launch.sh"].splitlines()[-1]
    for flags in ("-c 8192", "-np 4 --kv-unified", "-b 32 -ub 32", "-t 4 -tb 4", "--cache-prompt --cache-reuse 256", "--jinja"):
        assert flags in line
    golden("llama-server-colocated-chunk-32.sh", files["launch.sh"])
    replicas = recipe(plan_from_run(stored_run(), "replicas-2"), "llama-server").files["launch.sh"]
    assert "--port 8080" in replicas and "--port 8081" in replicas and "-t 2 -tb 2" in replicas


def test_an_adaptive_plan_gives_llama_server_the_itl_safe_chunk_the_run_predicted_else_its_largest():
    adaptive = {"name": "colocated-adaptive", "mode": "colocated", "chunk": 256, "adaptive_chunk": True}
    predicted = {"name": "colocated-chunk-16", "mode": "colocated", "chunk": 16,
                 "reason": "predicted by the step-time model for ITL <= 100 ms"}
    run = stored_dict()
    rec = run["recommendations"][0]["data"]
    rec["candidates"] = [*CANDIDATES, predicted, adaptive]
    got = recipe(plan_from_run(decode_run(run), "colocated-adaptive"), "llama-server")
    assert "-b 16 -ub 16" in got.files["launch.sh"] and any("predicted for the ITL target" in n for n in got.notes)
    rec["candidates"] = [*CANDIDATES, adaptive]           # a quick run predicts none: the largest chunk
    got = recipe(plan_from_run(decode_run(run), "colocated-adaptive"), "llama-server")
    assert "-b 256 -ub 256" in got.files["launch.sh"] and any("a full advise does" in n for n in got.notes)


def test_vllm_disaggregated_is_two_nixl_kv_both_servers_with_side_channel_ports_and_the_proxy():
    plan = plan_from_run(stored_run("disaggregated-routed"))
    text = recipe(plan, "vllm").files["launch.sh"]
    assert text.count('--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'') == 2
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in text and "VLLM_NIXL_SIDE_CHANNEL_PORT=5601" in text
    assert "--max-num-batched-tokens 256 --long-prefill-token-threshold 256" in text
    assert "toy_proxy_server.py --port 8000 --prefiller-host 127.0.0.1 --prefiller-port 8100" in text
    golden("vllm-disaggregated-routed.sh", text)
    colocated = recipe(plan_from_run(stored_run()), "vllm").files["launch.sh"]
    assert "--max-num-batched-tokens 32 --long-prefill-token-threshold 32" in colocated
    assert "--max-num-seqs 4 --max-model-len 8192" in colocated and "kv-transfer" not in colocated


def test_sglang_gets_the_chunk_and_for_disaggregation_prefill_decode_servers_behind_the_pd_router():
    plan = plan_from_run(stored_run("disaggregated-routed"))
    text = recipe(plan, "sglang").files["launch.sh"]
    assert "--disaggregation-mode prefill" in text and "--disaggregation-mode decode" in text
    assert text.count("--disaggregation-transfer-backend nixl") == 2 and "--chunked-prefill-size 256" in text
    assert ("sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30000 8998 --decode "
            "http://127.0.0.1:30001") in text
    golden("sglang-disaggregated-routed.sh", text)
    unchunked = recipe(plan_from_run(stored_run(), "colocated-unchunked"), "sglang").files["launch.sh"]
    assert "--chunked-prefill-size -1" in unchunked


def test_llm_d_s_pd_threshold_is_homepd_s_routing_threshold_and_replicas_get_prefix_cache_routing():
    text = recipe(plan_from_run(stored_run("disaggregated-routed")), "llm-d").files["epp-config.yaml"]
    assert "type: pd-profile-handler" in text and "threshold: 130" in text
    golden("llm-d-disaggregated-routed.yaml", text)
    replicas = recipe(plan_from_run(stored_run(), "replicas-2"), "llm-d").files["epp-config.yaml"]
    assert "pd-profile-handler" not in replicas and "prefix-cache-scorer" in replicas


def projection(keeps: dict[float, bool]) -> TwoBoxProjection:
    links = tuple(LinkProjection(g, 5.0, 9.0, 3000.0, 0.95 if ok else 0.5, ok) for g, ok in keeps.items())
    return TwoBoxProjection("disaggregated-routed", "mixed", 18432.0, 10, 100, 530, 2.0, 2500.0, 4000.0, 0.9,
                            links)


def test_two_boxes_get_replicas_unless_the_projected_network_row_keeps_the_ttft_budget():
    plan = plan_from_run(stored_run())
    assert "replicas behind a router" in two_box_answer(plan, [projection({1.0: False, 10.0: False})])
    assert "no projected network row" in two_box_answer(plan, [])
    across = two_box_answer(plan, [projection({1.0: False, 2.5: True, 10.0: True})])
    assert "across the wire" in across and "2.5 Gbit/s and faster" in across and "projected, not measured" in across


def test_the_export_carries_the_trace_and_the_benchmark_with_the_slo_as_each_tool_spells_it():
    run = stored_run()
    files = export_files(run, plan_from_run(run), "vllm")
    records = [json.loads(line) for line in files["trace-vllm.jsonl"].splitlines()]
    assert len(records) == 200 and set(records[0]) == {"prompt", "output_tokens"}
    assert "--goodput ttft:4000 tpot:100" in files["README.md"] and "--request-rate 0.84" in files["README.md"]
    assert "homepd bench slo --url http://127.0.0.1:8000" in files["README.md"]
    assert "smollm2-135m-instruct-q4_1" in files["README.md"] and "0.5 GB/s" in files["README.md"]
    sglang = bench_commands(plan_from_run(run), ExportEngine.SGLANG, "http://127.0.0.1:30000")
    assert "--dataset-path trace-sglang.jsonl" in sglang[0] and "--goodput ttft:4000 tpot:100" in sglang[0]
    assert "--slo-ttft-ms 4000 --slo-itl-ms 100 --slo-token gap" in sglang[1]


def test_advise_export_writes_the_directory_from_the_store(tmp_path, capsys):
    db = tmp_path / "runs.db"
    run = stored_dict()
    with Store.open(db) as store:
        run_id = store.begin_run("advise", run["config"], run["hardware"])
        store.add_recommendation(run_id, run["recommendations"][0]["data"], headline="colocated-chunk-32")
        store.finish_run(run_id)
    out = tmp_path / "recipe"
    assert main(["advise", "export", str(run_id), "--engine", "llama-server", "-o", str(out), "--db", str(db)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "launch.sh"]
    assert os.access(out / "launch.sh", os.X_OK) and "-b 32 -ub 32" in (out / "launch.sh").read_text()
    assert "replicas behind a router" in (out / "README.md").read_text()
    assert main(["advise", "export", str(run_id), "--engine", "vllm", "--candidate", "nope", "-o", str(out),
                 "--db", str(db)]) == 1
    assert "no candidate 'nope'" in capsys.readouterr().err
