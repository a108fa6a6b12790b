"""``homepd history show RUN --plot [--out F]``: the pictures of a stored run, written again, and where."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from homepd.main import main
from homepd.store import Store
from test_advise_pictures import curve
from test_store import make_record, make_steps

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def db(tmp_path, monkeypatch):
    """An advise run: two candidates on the mixed trace, a capacity curve kept with the recommendation."""
    monkeypatch.delenv("HOMEPD_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    path = tmp_path / "h.db"
    with Store.open(path) as s:
        run_id = s.begin_run("advise", {"base": {"ttft_budget_ms": 4000.0, "itl_budget_ms": 100.0}})
        s.add_result(run_id, "colocated-chunk-64", "mixed", 0, make_record(), make_steps(10))
        s.add_result(run_id, "disaggregated", "mixed", 0, make_record(mode="disaggregated"), make_steps(10))
        s.add_recommendation(run_id, {"headline": "colocated-chunk-64", "rule": "constructed",
                                      "capacity": [curve("colocated-chunk-64", "mixed", 0.4)]})
        s.finish_run(run_id)
    return path


def svg_text(path) -> tuple[str, set[str]]:
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    return (" ".join(t.text or "" for t in root.iter(SVG + "text")),
            {g.get("id") for g in root.iter(SVG + "g")})


def test_plot_writes_the_svg_and_png_where_asked_and_says_so(db, tmp_path, capsys):
    out = tmp_path / "pics" / "run1.svg"
    code = main(["history", "show", "1", "--db", str(db), "--plot", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["run1.png", "run1.svg"]
    assert f"wrote the pictures of run 1 to {out}, {out.with_suffix('.png')}" in stderr
    assert stdout.startswith("run 1: advise, complete")      # the run is shown as without --plot
    text, ids = svg_text(out)
    assert "colocated-chunk-64: 0.40 ± 0.05 req/s" in text and "budget 4000 ms" in text
    # the latency distributions come from the stored request timelines (every token's time)
    assert {"ttft_ms:colocated-chunk-64:mixed", "itl_ms:disaggregated:mixed", "capacity:colocated-chunk-64:mixed"} <= ids
    assert (out.with_suffix(".png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_defaults_to_the_advise_result_directory(db, tmp_path, capsys):
    assert main(["history", "show", "last", "--db", str(db), "--plot", "--json"]) == 0
    stdout, stderr = capsys.readouterr()
    where = db.parent / "advise"  # beside the database in use
    assert sorted(p.name for p in where.iterdir()) == ["advise-1.png", "advise-1.svg"]
    assert str(where / "advise-1.svg") in stderr
    assert '"requests"' not in stdout and '"id": 1' in stdout    # --json as without --plot: no timelines


def test_out_without_plot_is_refused(db, capsys):
    assert main(["history", "show", "1", "--db", str(db), "--out", "x.svg"]) != 0
    assert "add --plot" in capsys.readouterr().err
