"""A worker killed under load (fake backend, real processes and HTTP): the requests that arrive while it
restarts wait for it within their TTFT budget instead of being refused, and are counted."""
from __future__ import annotations

import os
import re
import signal
import threading

from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"


def one(server) -> tuple[int, float | None]:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        return r.status_code, r.json()["homepd"]["ttft_s"] if r.status_code == 200 else None


def test_requests_arriving_during_a_restart_complete_within_their_budget(tmp_path):
    server = ServeProcess(tmp_path, "--backend", "fake", "--n-seq-max", "4", "--max-queue", "64").wait_ready()
    try:
        pid = server.worker_pids()[0]
        results: list[tuple[int, float | None]] = []
        stop = threading.Event()

        def client_loop():
            while not stop.is_set():
                results.append(one(server))

        clients = [threading.Thread(target=client_loop) for _ in range(3)]
        for t in clients:
            t.start()
        server.wait_until(lambda s: len(results) >= 6, what="traffic flowing")
        os.kill(pid, signal.SIGKILL)
        server.wait_until(lambda s: not s["ready"], what="the death noticed")
        # why: the looping clients' requests were in flight on the dead worker (those are resumed); these
        # arrive while it restarts (a fake worker's restart takes ~0.3 s, a status poll ~0.02 s)
        arrivals = [threading.Thread(target=lambda: results.append(one(server))) for _ in range(3)]
        for t in arrivals:
            t.start()
        server.wait_until(lambda s: s["ready"] and s["engine"]["workers"][0]["pid"] != pid, what="the restart")
        n_after = len(results)
        server.wait_until(lambda s: len(results) >= n_after + 6, what="traffic after the restart")
        stop.set()
        for t in clients + arrivals:
            t.join()
        with server.client() as c:
            metrics = c.get("/metrics").text
        waited = re.search(r'homepd_restart_arrivals_total\{outcome="waited"\} (\S+)', metrics)
        assert waited and float(waited[1]) >= 3, metrics
        assert 'homepd_restart_arrivals_total{outcome="refused"}' not in metrics
        assert [code for code, _ in results if code != 200] == []
        assert all(ttft < 4.0 for _, ttft in results)  # the interactive TTFT budget, the restart's wait included
    finally:
        assert server.terminate() == 0, server.log()
