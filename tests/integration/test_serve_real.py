"""``homepd serve`` with the real model (SmolLM2-135M) over real HTTP: the official ``openai`` client streams a
chat completion and gets its usage; a worker that dies gives 503 while it restarts; SIGTERM during a
stream lets it finish and the process exits 0."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from openai import OpenAI

from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, default_model_path):
    """A models directory whose model is a symlink to the real one (so a test can break and restore it)."""
    directory = tmp_path_factory.mktemp("models")
    (directory / f"{MODEL}.gguf").symlink_to(default_model_path)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, models_dir):
    # why no prefix cache: the second of two greedy requests would reuse the first's prompt and compute only its
    # last token, a different batch whose logits differ in the last bits (llama.cpp is not batch-invariant), so
    # "the same answer, streamed or not" holds only where both compute the whole prompt alike
    proc = ServeProcess(tmp_path_factory.mktemp("real"), "--n-ctx", "1024", "--n-seq-max", "2", "--no-prefix-cache",
                        env={"HOMEPD_MODELS_DIR": str(models_dir)})
    yield proc.wait_ready()
    if proc.process.poll() is None:
        assert proc.terminate() == 0, proc.log()


@pytest.fixture
def openai_client(server):
    with OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60) as client:
        yield client


def test_openai_client_streams_a_chat_completion_with_usage(openai_client):
    assert MODEL in [m.id for m in openai_client.models.list()]
    stream = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text.strip() and finish in (["stop"], ["length"])
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    whole = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == text  # greedy: the same answer, streamed or not
    assert whole.usage.completion_tokens == usage.completion_tokens
    timings = whole.model_extra["homepd"]
    assert timings["mode"] == "colocated" and 0 < timings["ttft_s"] < 30 and timings["prompt_tok_s"] > 0


def test_dead_worker_gives_503_while_it_restarts_then_serves_again(server, models_dir, default_model_path):
    link = models_dir / f"{MODEL}.gguf"
    pid = server.worker_pids()[0]
    link.unlink()
    link.write_bytes(b"GGUF")  # the restart cannot load it: the restart window stays open for seconds
    try:
        os.kill(pid, signal.SIGKILL)
        with server.client() as client:
            server.wait_until(lambda s: not s["ready"], what="the worker's death noticed")
            assert client.get("/ready").json()["status"] == "worker_restarting"
            # a request would wait while the restart is expected back in time; this one cannot load, so it is
            # late, and a request is refused
            server.wait_until(lambda s: s["admission"]["restart_eta_s"] is None, what="the restart overdue")
            refused = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "worker_restarting"
    finally:
        link.unlink()
        link.symlink_to(default_model_path)
    server.wait_ready()
    with server.client() as client:
        status = client.get("/status").json()
        assert status["engine"]["workers"][0]["restarts"] >= 1 and status["engine"]["workers"][0]["pid"] != pid
        assert status["engine"]["workers"][0]["flash_attn"] is False  # a CPU worker: off (docs/scheduling.md)
        ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert "homepd_worker_restarts_total" in client.get("/metrics").text


def test_sigterm_during_a_stream_lets_it_finish_and_exits_0(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        data = []
        for line in lines:
            if line.startswith("data: "):
                data.append(line[6:])
                if len(data) == 2:  # the role chunk and the first token
                    server.process.send_signal(signal.SIGTERM)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["homepd"]["n_output_tokens"] == 24
    assert server.process.wait(60) == 0, server.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
