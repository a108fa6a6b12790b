"""``homepd advise`` draws its pictures next to the JSON result file, carries the two-box rows (projected, not
measured) in the JSON, and ``homepd history show RUN --plot`` draws them again from the store (fake backend,
real worker processes, real store, real CLI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from homepd.measure.trace import make_trace, write_trace
from homepd.osutil import die_with_parent

# advise places every architecture (tests/conftest.py, BoxShare); the fake backend: the pictures, not the speed
pytestmark = pytest.mark.two_cores

SVG = "{http://www.w3.org/2000/svg}"


def homepd(*args, env):
    return subprocess.run([sys.executable, "-m", "homepd", *args], capture_output=True, text=True, env=env,
                          timeout=300, preexec_fn=die_with_parent)


def svg_ids(path) -> set[str]:
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    return {g.get("id") for g in root.iter(SVG + "g")}


def test_advise_writes_its_pictures_and_history_plot_writes_them_again(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HOMEPD_DB"}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    db = tmp_path / "runs.db"
    # why a trace file of five requests: the pictures are drawn from whatever the campaign measured; on the
    # default mixed trace the campaign took 12 s, on this 8 s
    trace = tmp_path / "five.jsonl"
    write_trace(make_trace("mixed", 5, 4.0, max_tokens=6, seed=3), trace)
    out = homepd("advise", "--quick", "--backend", "fake", "--db", str(db), "--json", "--no-recovery",
                 "--candidates", "colocated-chunk-256,disaggregated", "--twin-seeds", "5", "--trace-file", str(trace),
                 env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    where = tmp_path / "advise"  # beside the database in use, not in the default data directory
    stem = where / f"advise-{result['run_id']}"
    svg, png = stem.with_suffix(".svg"), stem.with_suffix(".png")
    assert f"pictures: {svg}, {png}" in out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ids = svg_ids(svg)
    measured = {(r["candidate"], r["mix"]) for r in result["runs"]}
    for cand, mix in measured:  # every candidate's TTFT and gap distribution on every mix
        assert f"ttft_ms:{cand}:{mix}" in ids and f"itl_ms:{cand}:{mix}" in ids
    # the two-box rows: the disaggregated candidate on every mix, each marked projected
    rows = result["projected_two_box"]
    assert {(r["candidate"], r["mix"]) for r in rows} == {(c, m) for c, m in measured if c.startswith("disagg")}
    assert all(r["note"] == "projected, not measured" for r in rows)
    moved = [r for r in rows if r["links"]]
    assert moved and all([link["link_gbit_s"] for link in r["links"]] == [1.0, 2.5, 10.0] for r in moved)
    assert all(r["kv_bytes_per_token"] > 0 for r in moved)

    again = tmp_path / "again" / "run"
    shown = homepd("history", "show", str(result["run_id"]), "--db", str(db), "--plot", "--out", str(again), env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"to {again}.svg, {again}.png" in shown.stderr
    assert svg_ids(f"{again}.svg") >= {i for i in ids if i and i.startswith(("ttft_ms:", "itl_ms:"))}
