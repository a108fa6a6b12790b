"""What wins becomes what runs: ``homepd advise apply --candidate`` on a stored run (real sqlite, real CLI), then
``homepd serve`` (fake backend, real HTTP) runs that candidate and says so at start-up; without advice it runs
the built-in adaptive chunk and says that."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from homepd.config import EngineConfig
from homepd.core.modes import Mode
from homepd.core.records import to_plain
from homepd.engine.topology import topology_for
from homepd.store import Store
from test_serve_harness import ServeProcess
from homepd.osutil import die_with_parent


def stored_advise_run(db) -> int:
    """An advise run as the campaign stores it: every candidate of this box, colocated-adaptive recommended."""
    plan = types.SimpleNamespace(**{part: types.SimpleNamespace(feasible=True, reason="")
                                    for part in ("colocated", "disaggregated", "replicas")})
    candidates = [c for m in Mode for c in topology_for(m).advise_candidates(EngineConfig(), plan, (None, 64))]
    best = next(c for c in candidates if c.name == "colocated-adaptive")
    with Store.open(db) as store:
        run = store.begin_run("advise", {})
        store.add_recommendation(run, {"candidate": to_plain(best), "config": to_plain(best.config_values()),
                                       "reason": "constructed", "candidates": to_plain(candidates)})
        store.finish_run(run)
    return run


def apply(db, conf, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEPD_")}
    return subprocess.run([sys.executable, "-m", "homepd", "advise", "apply", *args, "--db", str(db),
                           "--config-file", str(conf), "--yes"], capture_output=True, text=True, env=env, timeout=120, preexec_fn=die_with_parent)


def one_reply(proc: ServeProcess, prompt: str) -> dict:
    with proc.client() as client:
        model = client.get("/status").json()["models"][0]
        reply = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return reply.json()["homepd"]


@pytest.mark.two_cores  # the applied candidate is disaggregated (fake backend: what it runs, not its speed)
def test_serve_runs_the_applied_candidate_and_says_so_at_start_up(tmp_path):
    db, conf = tmp_path / "runs.db", tmp_path / "config.toml"
    run = stored_advise_run(db)
    applied = apply(db, conf, str(run), "--candidate", "disaggregated")
    assert applied.returncode == 0, applied.stderr
    assert "disaggregated is not the recommended candidate (colocated-adaptive)" in applied.stderr

    proc = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "2048", env={"HOMEPD_CONFIG": str(conf)})
    try:
        proc.wait_ready()
        with proc.client() as client:
            status = client.get("/status").json()
        why = f"applied advice from run {run} (candidate disaggregated)"
        assert status["configuration"] == {"source": "advice", "configuration": "disaggregated, every prompt "
                                           "handed off", "why": why, "run_id": run, "candidate": "disaggregated"}
        assert {w["role"] for w in status["engine"]["workers"]} == {"prefill", "decode"}
        timings = one_reply(proc, "word " * 40)
        assert timings["mode"] == "disaggregated" and timings["kv_bytes"]  # handed off, as the candidate says
        assert status["engine"]["admission"]["adaptive_chunk"] is False
    finally:
        assert proc.terminate() == 0
    log = proc.log()
    assert f"homepd: running disaggregated, every prompt handed off — {why}" in log
    assert f"ready (disaggregated, " in log and why in log.split("ready (")[1]


def test_serve_without_advice_runs_the_adaptive_chunk_and_says_it_is_the_built_in_default(tmp_path):
    proc = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "2048")
    try:
        proc.wait_ready()
        with proc.client() as client:
            status = client.get("/status").json()
        assert status["configuration"]["source"] == "default"
        assert status["configuration"]["configuration"] == "colocated, adaptive chunk (at most 256)"
        assert status["configuration"]["why"].startswith("built-in default")
        assert status["engine"]["mode"] == "colocated" and status["engine"]["admission"]["adaptive_chunk"] is True
        assert one_reply(proc, "hi")["mode"] == "colocated"
    finally:
        assert proc.terminate() == 0
    assert "homepd: running colocated, adaptive chunk (at most 256) — built-in default" in proc.log()
