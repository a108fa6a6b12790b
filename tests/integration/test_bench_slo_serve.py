"""``homepd bench slo`` over real HTTP: a real ``homepd serve --backend fake`` measured at two fixed rates by
the real command, stored as a bench-slo run, and shown by ``homepd history show``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from homepd.store import Store

from test_serve_harness import API_KEY, ServeProcess
from homepd.osutil import die_with_parent


def homepd(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "homepd", *args], env=env, capture_output=True, text=True,
                          timeout=120, preexec_fn=die_with_parent)


def test_bench_slo_measures_homepd_serve_at_two_rates_stores_the_run_and_history_shows_it(tmp_path):
    db = tmp_path / "bench.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOMEPD_", "OPENAI_"))}
    serve = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "2048").wait_ready()
    try:
        out = homepd("bench", "slo", "--url", f"homepd-fake={serve.url}", "--rates", "4,8", "--requests", "8",
                     "--max-tokens", "8", "--stop-below", "0", "--api-key", API_KEY, "--db", str(db), "--json", env=env)
    finally:
        assert serve.terminate() == 0, serve.log()
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    (server,) = answer["servers"]
    assert server["name"] == "homepd-fake" and server["model"] == "smollm2-135m-instruct-q4_1"  # from /v1/models
    # both rates probed whatever the attainment (--stop-below 0: a slow CI box must not skip the second)
    assert [p["rate_rps"] for p in server["probes"]] == [4.0, 8.0]
    assert all(p["n_requests"] == 8 and p["n_failed"] == 0 for p in server["probes"])
    assert all(p["ttft_p50_ms"] > 0 and p["max_gap_p50_ms"] is not None for p in server["probes"])
    with Store.open(db, create=False) as store:
        run = store.get_run(answer["run_id"], timelines=True)
    assert (run["kind"], run["status"]) == ("bench-slo", "complete")
    assert [r["mix"] for r in run["results"]] == ["mixed@4/s", "mixed@8/s"]
    # every request of both probes (and the warm-up) reached the server and streamed its 8 chunks
    assert all(len(r["record"]["requests"]) == 8 for r in run["results"])
    assert all(req["n_output_tokens"] == 8 and req["n_prompt_tokens"] > 0
               for r in run["results"] for req in r["record"]["requests"])
    shown = homepd("history", "show", "last", "--db", str(db), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "bench-slo, complete" in shown.stdout and "SLO capacity" in shown.stdout
    assert "homepd-fake" in shown.stdout and "attainment per rate: 4/s " in shown.stdout and "8/s " in shown.stdout
