"""The dispatcher above the faces: every command module is imported (a command line naming one imports that one
alone), and one that fails stops homepd."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest

import homepd.main as homepd_main


@pytest.fixture
def broken_faces(tmp_path, monkeypatch):
    """Two command modules on the path: one whose own import fails inside it, one that is missing."""
    (tmp_path / "homepd_face_broken.py").write_text("import homepd_no_such_library\n\ndef register(sub): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name,cause", [("homepd_face_broken", "homepd_no_such_library"),
                                        ("homepd_face_missing", "homepd_face_missing")])
def test_a_face_that_fails_to_import_stops_homepd_naming_it(broken_faces, monkeypatch, name, cause):
    monkeypatch.setattr(homepd_main, "COMMAND_MODULES", (*homepd_main.COMMAND_MODULES, name))
    with pytest.raises(homepd_main.FaceImportError, match=rf"command module {name} failed to import .*{cause}"):
        homepd_main.main(["--help"])


def test_every_shipped_face_registers_its_commands():
    commands = homepd_main.build_parser()._subparsers._group_actions[0].choices
    assert {"app", "serve", "advise", "run", "bench", "trace", "probe", "models", "history"} <= set(commands)


def test_each_command_is_owned_by_the_module_that_registers_it():
    for name in homepd_main.COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        assert {c for c, owner in homepd_main.COMMAND_OWNERS.items() if owner == name} == set(sub.choices), name


def test_a_command_line_imports_its_commands_module_alone(capsys):
    """``homepd serve ...`` builds the serve parser without the advise campaign, the app or the benchmarks."""
    probe = ("import sys, homepd.main as m; p = m.build_parser('serve'); "
             "print(sorted(p._subparsers._group_actions[0].choices), "
             "sorted(n for n in m.COMMAND_MODULES if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['serve',", "'service']", "['homepd.serve.command']"]
    # a word that is no command: every module, so argparse names the commands there are
    with pytest.raises(SystemExit):
        homepd_main.main(["servee"])
    err = capsys.readouterr().err
    assert "invalid choice: 'servee'" in err and all(f"'{c}'" in err for c in homepd_main.COMMAND_OWNERS)


@pytest.mark.parametrize("preset", [None, "2"])
def test_homepd_runs_numpys_blas_on_one_thread_unless_the_user_set_it(preset):
    """Set before a command imports numpy, so that homepd and every process it starts (the engine's workers inherit
    it) start no BLAS thread per core; a user's own value is kept.  The probe widens its affinity to every core
    first (the suite pins its workers to one, where OpenBLAS starts no thread of its own anyway)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    probe = ("import os, contextlib, homepd.main as m\n"
             "os.sched_setaffinity(0, range(os.cpu_count()))\n"
             "with contextlib.redirect_stdout(None), contextlib.suppress(SystemExit): m.main(['advise', '--help'])\n"
             "import numpy\n"
             "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    blas, threads = out.split()
    assert blas == (preset or "1")
    assert int(threads) == (1 if preset is None else min(2, os.cpu_count()))
