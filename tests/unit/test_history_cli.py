"""``homepd history`` / ``history show`` / ``history export`` through the real dispatcher, on tmp databases."""
from __future__ import annotations

import json

import pytest

from homepd.main import main
from homepd.store import Store
from test_store import make_record, make_steps

HARDWARE = {"cpu": {"model": "Celeron N5105", "logical_cores": 4}, "memory": {"ram_total_bytes": 16 << 30},
            "gpus": []}


@pytest.fixture
def db(tmp_path, monkeypatch):
    """A database with a finished advise run (2 candidates x 2 mixes x 2 repeats, one infeasible candidate,
    a recommendation) and a run whose writer died."""
    monkeypatch.delenv("HOMEPD_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-unused"))
    path = tmp_path / "h.db"
    with Store.open(path) as s:
        run_id = s.begin_run("advise", {"slo": {"ttft_ms": 500}}, HARDWARE, {"mixes": ["short", "long"]})
        for cand in ("colocated", "chunk64"):
            for mix in ("short", "long"):
                for repeat in range(2):
                    s.add_result(run_id, cand, mix, repeat, make_record(with_death=(cand, repeat) == ("chunk64", 1)),
                                 make_steps(10))
        s.add_infeasible(run_id, "disaggregated", "model does not fit twice")
        s.add_recommendation(run_id, {"headline": "colocated, chunk 64", "rule": "no interference",
                                      "evidence": [1, 2]})
        s.finish_run(run_id)
        dead = s.begin_run("run", {"mode": "colocated"})
        s.db["runs"].update(dead, {"writer_pid": 2 ** 22 + 1})  # no such process
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_history_lists_runs_newest_first_with_status_candidates_and_recommendation(db, capsys):
    code, out, _ = run_cli(capsys, "history", "--db", str(db))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert rows[0][:2] == ["2", "run"] and "incomplete" in rows[0]
    assert rows[1][:2] == ["1", "advise"] and "complete" in rows[1]
    assert "3: colocated, chunk64, disag" in out and out.splitlines()[2].endswith("colocated, chunk 64")


def test_history_json_lists_the_same_runs(db, capsys):
    code, out, _ = run_cli(capsys, "history", "--db", str(db), "--json", "--limit", "1")
    runs = json.loads(out)
    assert code == 0 and [r["id"] for r in runs] == [2] and runs[0]["status"] == "incomplete"


def test_history_reads_homepd_db_from_the_environment(db, capsys, monkeypatch):
    monkeypatch.setenv("HOMEPD_DB", str(db))
    code, out, _ = run_cli(capsys, "history")
    assert code == 0 and "advise" in out and str(db) in out


def test_history_on_a_missing_database_says_so_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "none.db"
    code, out, _ = run_cli(capsys, "history", "--db", str(missing))
    assert code == 0 and out.strip() == f"no runs recorded in {missing}"
    assert not missing.exists()


def test_show_prints_the_evidence_table_and_the_recommendation(db, capsys):
    code, out, _ = run_cli(capsys, "history", "show", "1", "--db", str(db))
    assert code == 0
    assert "run 1: advise, complete" in out
    assert "Celeron N5105 (4 logical cores), 16.0 GiB RAM, no GPU" in out
    table = {tuple(line.split()[:3]): line.split() for line in out.splitlines()
             if line.startswith(("colocated", "chunk64"))}
    assert set(table) == {(c, m, "2") for c in ("colocated", "chunk64") for m in ("short", "long")}
    s = make_record().summary
    cells = table[("chunk64", "long", "2")]
    assert cells[3] == f"{s.goodput_per_s:.2f}" and cells[5] == f"{s.ttft_ms.p99:.0f}"
    assert cells[-1] == "1" and table[("colocated", "long", "2")][-1] == "0"  # deaths summed over repeats
    assert "disaggregated" in out and "infeasible: model does not fit twice" in out
    assert "recommendation: colocated, chunk 64" in out and "rule: no interference" in out


def test_show_last_is_the_newest_run_and_names_its_missing_writer(db, capsys):
    code, out, _ = run_cli(capsys, "history", "--db", str(db), "show", "last")
    assert code == 0 and out.startswith("run 2: run, incomplete")
    assert "writer process 4194305 ended without finishing the run" in out
    assert "no results recorded" in out and "recommendation: none recorded" in out


def test_show_json_is_the_run_without_timelines(db, capsys):
    code, out, _ = run_cli(capsys, "history", "show", "1", "--json", "--db", str(db))
    run = json.loads(out)
    assert code == 0 and run["id"] == 1 and len(run["results"]) == 9
    assert "steps" not in run["results"][0] and "requests" not in run["results"][0]["record"]


@pytest.mark.parametrize("ref", ["42", "first", "-1"])
def test_a_bad_run_is_an_error_naming_it(db, capsys, ref):
    for action in ("show", "export"):
        code, out, err = run_cli(capsys, "history", action, ref, "--db", str(db))
        assert (code, out) == (1, "")
        assert f"no run {ref!r} in {db}" in err


def test_show_on_a_missing_database_is_an_error_naming_the_run(tmp_path, capsys):
    code, _, err = run_cli(capsys, "history", "show", "last", "--db", str(tmp_path / "none.db"))
    assert code == 1 and "no run 'last'" in err and not (tmp_path / "none.db").exists()


def test_export_writes_the_full_run_as_json_to_a_file(db, tmp_path, capsys):
    target = tmp_path / "run1.json"
    code, out, err = run_cli(capsys, "history", "export", "1", "-o", str(target), "--db", str(db))
    assert code == 0 and out == "" and str(target) in err
    data = json.loads(target.read_text())
    with Store.open(db) as s:
        assert data == json.loads(json.dumps(s.export_run(1)))
    assert data["format"] == "homepd-run" and len(data["results"][0]["record"]["requests"]) == 3
    assert len(data["results"][0]["steps"]) == 10 and data["recommendations"][0]["data"]["evidence"] == [1, 2]


def test_export_to_stdout_and_to_an_unwritable_path(db, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "history", "export", "last", "--db", str(db))
    assert code == 0 and json.loads(out)["id"] == 2
    code, _, err = run_cli(capsys, "history", "export", "1", "-o", str(tmp_path / "no" / "dir.json"), "--db", str(db))
    assert code == 1 and "cannot write" in err and "dir.json" in err
