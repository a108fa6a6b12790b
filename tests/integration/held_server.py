"""Not collected by the suite (no ``test_`` prefix): the nested run of ``test_interrupted_run``.  Its one test starts
a ``homepd serve`` (fake backend), writes the server's and its workers' pids to ``$HOMEPD_HELD_PIDS`` and waits
there until the run is interrupted."""
from __future__ import annotations

import os
import threading

from test_serve_harness import ServeProcess


def test_hold_a_server_until_interrupted(tmp_path):
    server = ServeProcess(tmp_path, "--backend", "fake").wait_ready()
    pids = [server.process.pid, *server.worker_pids()]
    with open(os.environ["HOMEPD_HELD_PIDS"], "w") as out:
        out.write(" ".join(map(str, pids)) + "\n")
    threading.Event().wait(600)  # why: held until the outer test kills this run
