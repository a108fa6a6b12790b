"""``homepd advise`` end to end on the fake backend (real worker processes, real store, real CLI), the
kill -9 of an advise process mid-run, and ``advise apply``.  The campaign's figures with the real model are
a benchmark (docs/advise.md), not a test."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import psutil
import pytest

from engine_helpers import make_engine
from engine_helpers import run as run_async
from homepd.config import EngineConfig, read_config_file
from homepd.kv.segment import SHM_DIR, parse_segment_name
from homepd.store import Store
from homepd.tui.sources.embedded import EmbeddedSource
from homepd.osutil import die_with_parent


SVG = "{http://www.w3.org/2000/svg}"


def svg_ids(path) -> set[str]:
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    return {g.get("id") for g in root.iter(SVG + "g")}


def check_pictures(tmp_path, stderr: str, result: dict, env: dict) -> None:
    """The campaign's pictures beside its JSON result file (every candidate's TTFT and gap distributions on every
    mix), its two-box rows (projected, not measured) in the JSON, and ``homepd history show RUN --plot`` drawing
    them again from the store.  (Checked on the quick campaign's run: a campaign of its own took 18 s of the
    suite on two busy cores.)"""
    stem = tmp_path / "advise" / f"advise-{result['run_id']}"
    svg, png = stem.with_suffix(".svg"), stem.with_suffix(".png")
    assert f"pictures: {svg}, {png}" in stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ids = svg_ids(svg)
    measured = {(r["candidate"], r["mix"]) for r in result["runs"]}
    for cand, mix in measured:
        assert f"ttft_ms:{cand}:{mix}" in ids and f"itl_ms:{cand}:{mix}" in ids
    # the two-box rows: the disaggregated candidate on every mix, each marked projected
    rows = result["projected_two_box"]
    assert {(r["candidate"], r["mix"]) for r in rows} == {(c, m) for c, m in measured if c.startswith("disagg")}
    assert all(r["note"] == "projected, not measured" for r in rows)
    # the links where KV was handed off (learned routing may keep every prompt of the checks on the decode
    # worker: then the row says so; tests/unit/test_advise_pictures.py draws both kinds)
    for r in rows:
        assert r["reason"].startswith("no KV was handed off") if not r["links"] else \
            [link["link_gbit_s"] for link in r["links"]] == [1.0, 2.5, 10.0] and r["kv_bytes_per_token"] > 0

    again = tmp_path / "again" / "run"
    shown = homepd("history", "show", str(result["run_id"]), "--db", str(tmp_path / "runs.db"), "--plot",
                   "--out", str(again), env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"to {again}.svg, {again}.png" in shown.stderr
    assert svg_ids(f"{again}.svg") >= {i for i in ids if i and i.startswith(("ttft_ms:", "itl_ms:"))}


def homepd(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "homepd", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, **kw, preexec_fn=die_with_parent)


@pytest.mark.two_cores  # every architecture: disaggregated and replicas too (fake backend: structure, not speed)
def test_quick_advise_searches_every_architectures_capacity_on_the_mixed_trace_stores_it_and_apply_writes_it(
        tmp_path):
    db, conf = tmp_path / "runs.db", tmp_path / "config.toml"
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}  # the pictures go beside the database, not in the data dir
    # why fewer twin runs and shorter ones: the fake is never slow, so its twin searches up to the 64 req/s
    # ceiling (200-request runs: 24 CPU-s of the suite)
    out = homepd("advise", "--quick", "--backend", "fake", "--db", str(db), "--json", "--twin-seeds", "5",
                 "--twin-requests", "50", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not (tmp_path / "xdg").exists()
    check_pictures(tmp_path, out.stderr, result, env)
    rows = [r for r in result["evidence"] if "infeasible" not in r]
    names = {r["candidate"] for r in rows}
    # quick: the best scheduler of colocated and of disaggregated serving
    assert names == {"colocated-adaptive", "disaggregated-routed"}
    assert {r["mix"] for r in rows} == {"mixed"}   # quick: the mixed trace only
    for r in rows:  # every candidate was searched, and the figures at its capacity are there
        curve = r["capacity"]
        assert curve["candidate"] == r["candidate"] and curve["mix"] == "mixed" and curve["decided_by"]
        assert 1 <= len(curve["probes"]) <= 3 and all(p["n_requests"] >= 10 for p in curve["probes"])
        rates = [p["rate_rps"] for p in curve["probes"]]
        assert len(set(rates)) == len(rates)   # a search never probes a rate twice
        assert r["twin"]["n_seeds"] >= 5 and r["twin"]["n_requests"] == 50   # the flags reach the twin
        assert r["goodput_per_s"] is not None and r["ttft_ms_p99"] is not None and r["total_pss_mib"] > 0
    assert result["calibration"]["prefill_tok_s"] > 0
    rec = result["recommendation"]
    assert rec["candidate"]["name"] in names and rec["rule"] and rec["confidence"] in ("high", "medium", "low")
    assert {a["mix"] for a in rec["per_mix"]} == {"mixed"}
    assert "[" in out.stderr and "ETA" in out.stderr  # the progress bar

    with Store.open(db, create=False) as store:   # one stored result per probe, its rate in the mix
        (run,) = store.list_runs()
        results = store.get_run(run["id"], timelines=False)["results"]
        probes = sum(len(r["capacity"]["probes"]) for r in rows)
        assert len([r for r in results if r["status"] == "measured" and "@" in r["mix"]]) == probes

    # the app's advise screen opens on this stored run: its recommendation, each twin's band and its checks
    view = EmbeddedSource(EngineConfig(backend="fake"), db=str(db)).latest_run()
    assert view.run_id == run["id"] and view.recommendation.candidate == rec["candidate"]["name"]
    assert {t.candidate for t in view.pictures.twins} == names
    assert all(t.points and t.checks for t in view.pictures.twins)

    # what-if on its calibration: the traffic doubled (the capacity is the run's; the attainment at twice the
    # recommended capacity is projected), and a bad mix named
    # (on the run's backend, the fake: no model is pulled or needed, as on a fresh clone)
    whatif = homepd("advise", "what-if", "--db", str(db), "--rate-scale", "2", "--json",
                    env={"HOMEPD_MODELS_DIR": str(tmp_path / "no-models")})
    assert whatif.returncode == 0, whatif.stderr
    projected = json.loads(whatif.stdout.strip().splitlines()[-1])
    assert projected["projected_from"] == f"run {run['id']}'s calibration" and projected["change"] == "traffic x2"
    assert {c["candidate"] for c in projected["candidates"]} == names
    assert all(0.0 <= c["attainment_at_reference"] <= 1.0 and c["reference_rps"] > 0 for c in projected["candidates"])
    bad = homepd("advise", "what-if", "--db", str(db), "--mix", "medium=1")
    assert bad.returncode != 0 and "--mix" in bad.stderr

    listing = homepd("history", "--db", str(db))
    assert listing.returncode == 0 and "advise" in listing.stdout and "complete" in listing.stdout

    applied = homepd("advise", "apply", "--db", str(db), "--config-file", str(conf), "--yes")
    assert applied.returncode == 0, applied.stderr
    written = read_config_file(conf)
    assert written["mode"] == rec["config"]["mode"]
    assert written.get("chunk", "none") == (rec["config"]["chunk"] if rec["config"]["chunk"] is not None else "none")


def test_apply_without_a_terminal_or_yes_changes_nothing(tmp_path):
    db = tmp_path / "runs.db"
    with Store.open(db) as store:
        run = store.begin_run("advise", {})
        store.add_recommendation(run, {"config": {"mode": "colocated", "chunk": 64}, "reason": "test"})
        store.finish_run(run)
    conf = tmp_path / "config.toml"
    out = homepd("advise", "apply", "--db", str(db), "--config-file", str(conf), stdin=subprocess.DEVNULL)
    assert out.returncode == 1 and "--yes" in out.stderr and not conf.exists()
    missing = homepd("advise", "apply", "42", "--db", str(db), "--config-file", str(conf), "--yes")
    assert missing.returncode == 1 and "42" in missing.stderr and not conf.exists()


@pytest.mark.two_cores  # every architecture: disaggregated and replicas too (fake backend: structure, not speed)
def test_kill_9_of_advise_mid_run_leaves_a_sound_database_and_an_incomplete_run(tmp_path):
    db = tmp_path / "runs.db"
    # why --no-twin: its probes store their results one by one within 2 s (with the twin, the second stored result
    # came 8 s in, after a calibration burst, the twin's simulation and its check)
    proc = subprocess.Popen([sys.executable, "-m", "homepd", "advise", "--quick", "--backend", "fake", "--no-twin",
                             "--db", str(db)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=die_with_parent)
    try:
        seen = b""
        while b"] 1/" not in seen:  # the progress line after the first probe's result
            chunk = proc.stderr.read1(4096)
            assert chunk, f"advise ended before its first probe's result: {seen[-500:]!r}"
            seen += chunk
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # its workers see their pipe close, unlink the KV segments they attached and exit
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
    finally:
        proc.kill()
    # a segment it made for its next candidate before any worker attached has nobody left to unlink it: the next
    # engine to start sweeps the segments of dead controllers
    run_async(engine_start_and_stop(EngineConfig(backend="fake", mode="disaggregated", n_ctx=2048)))
    assert not [n for n in os.listdir(SHM_DIR) if (parse_segment_name(n) or (0,))[0] == proc.pid]
    with Store.open(db, create=False) as store:
        assert store.integrity_check() == "ok"
        (run,) = store.list_runs()
        assert run["status"] == "incomplete"
        results = store.get_run(run["id"], timelines=False)["results"]
        measured = [r for r in results if r["status"] == "measured"]
        # what was stored before the kill is there, whole
        assert len(measured) >= 1 and all(r["record"] is not None for r in measured)


async def engine_start_and_stop(config):
    async with make_engine(config):
        pass

