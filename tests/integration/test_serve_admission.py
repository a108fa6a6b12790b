"""Early rejection at the service: 503 with Retry-After and a clear code, never a late failure; the decisions,
queues and chosen chunk show in /metrics and /status (real HTTP server, fake backend: real worker processes)."""
from __future__ import annotations

import pytest

from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a TTFT budget no prediction can meet: every request is rejected once the worker's speed is measured
    proc = ServeProcess(tmp_path_factory.mktemp("admission"), "--backend", "fake", "--n-ctx", "2048",
                        "--chunk", "8", "--admission", "--ttft-budget", "0.000001", "--no-warmup")
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


def test_rejected_early_with_503_retry_after_and_counted(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 2}
    with server.client() as client:
        statuses = []
        for _ in range(20):  # admitted while the worker's prefill speed is unmeasured, then refused
            r = client.post("/v1/chat/completions", json=body)
            statuses.append(r.status_code)
            if r.status_code == 503:
                break
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        error = r.json()["error"]
        assert error["code"] == "admission_rejected" and "predicted TTFT" in error["message"]
        assert int(r.headers["Retry-After"]) >= 1
        metrics = client.get("/metrics").text
        status = client.get("/status").json()
        # the service is still up and the rejected request never reached a worker
        assert client.get("/ready").status_code == 200
    assert 'homepd_admission_decisions_total{decision="rejected",request_class="interactive"} 1.0' in metrics
    assert f'homepd_admission_decisions_total{{decision="admitted",request_class="interactive"}} ' \
           f'{float(len(statuses) - 1)}' in metrics
    assert 'homepd_step_prompt_budget_tokens{role="colocated"}' in metrics
    adm = status["engine"]["admission"]
    assert adm["admission"] is True and adm["classes"][0]["rejected"] == 1
