"""An interrupted pytest leaves no ``homepd`` process behind: a nested run (one xdist worker, as the suite runs
its tests) starts a server, is sent SIGTERM and then SIGINT, and the server and its workers are gone soon after.
Its xdist worker notices the run's end (``tests/conftest.py``, ``end_with_the_run``) and the server dies with it
(``homepd.osutil.die_with_parent``); before, one kept a core busy for 25 minutes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from homepd.osutil import pid_alive

HERE = Path(__file__).resolve().parent


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling a process table and a file: what there is to watch
    return predicate()


def test_an_interrupted_run_leaves_no_homepd_process(tmp_path):
    held = tmp_path / "pids"
    # why: not the suite's own xdist worker's variables (the nested run's main would take itself for a worker)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HOMEPD_"))}
    env["HOMEPD_HELD_PIDS"] = str(held)
    # why: of the installed plugins only xdist's (and the timeout the suite's ini sets) are the suite's way of
    # running a test; autoloaded, the others (hypothesis, schemathesis: their whole packages assert-rewritten in
    # both processes) took 5 of the nested run's 7.5 s before its server was up; and since the suite's addopts
    # name the plugins it uses, those are not read either (-o addopts=: its server up at 2.6 s instead of 4.0 s)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "xdist.plugin",
                            "-p", "pytest_timeout", "-p", "no:cacheprovider", "-o", "addopts=",
                            str(HERE / "held_server.py")],
                           cwd=HERE.parents[1], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        text = wait_for(lambda: held.exists() and held.read_text().endswith("\n") and held.read_text(), 180)
        assert text, "the nested run never started its server"
        pids = [int(p) for p in text.split()]
        assert len(pids) >= 2 and all(pid_alive(p) for p in pids)
        run.send_signal(signal.SIGTERM)
        run.wait(30)
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
        left = wait_for(lambda: not [p for p in pids if pid_alive(p)] or None, 60)
        assert left, f"still running after the run was interrupted: {[p for p in pids if pid_alive(p)]}"
    finally:
        for pid in [p for p in pids if pid_alive(p)]:
            os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
            run.wait()
