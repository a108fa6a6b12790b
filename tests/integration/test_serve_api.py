"""``homepd serve`` over real HTTP (fake backend): OpenAI shapes, every documented error, the API key,
/metrics, /status, /events, and a schemathesis fuzz of the OpenAPI document that must find no 5xx."""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
N_CTX = 256
MAX_TOKENS = 64
MAX_PROMPT_BYTES = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("api"), "--backend", "fake", "--n-ctx", str(N_CTX),
                        "--max-tokens", str(MAX_TOKENS), "--max-prompt-bytes", str(MAX_PROMPT_BYTES),
                        "--embedding-model", "all-minilm-l6-v2")  # the fake's: the embedding routes fuzzed too
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def assert_error(response: httpx.Response, status: int, type_: str, code: str | None = None,
                 param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert MODEL in [m["id"] for m in data]


def test_chat_completion_shape_with_timings(client):
    body = client.post("/v1/chat/completions", json=chat(temperature=0)).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 4
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    timings = body["homepd"]
    assert timings["mode"] == "colocated" and timings["request_class"] == "interactive"
    assert timings["ttft_s"] > 0 and timings["tpot_s"] > 0 and timings["n_output_tokens"] == 4


def test_streamed_completion_ends_with_usage_and_done(client):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "request_class": "background"}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        client.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()["choices"][0]["text"]
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["homepd"]["request_class"] == "background"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_continuous_usage_stats_counts_tokens_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats, which GuideLLM sends."""
    body = chat(max_completion_tokens=3, max_tokens=None, stream=True, ignore_eos=True, stop=None,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3 and all(c["usage"] for c in chunks)


def test_request_class_header(client):
    body = client.post("/v1/chat/completions", json=chat(), headers={"X-Homepd-Class": "Background"}).json()
    assert body["homepd"]["request_class"] == "background"
    assert_error(client.post("/v1/chat/completions", json=chat(), headers={"X-Homepd-Class": "urgent"}),
                 400, "invalid_request_error", param="X-Homepd-Class")
    assert_error(client.post("/v1/chat/completions", json=chat(request_class="interactive"),
                             headers={"X-Homepd-Class": "background"}), 400, "invalid_request_error")


@pytest.mark.parametrize("body, param, code", [
    (chat(n=2), "n", None),
    (chat(logprobs="yes"), "logprobs", None),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs", None),
    (chat(top_logprobs=2), "body", None),
    (chat(tools=[{"type": "function"}]), None, None),
    (chat(presence_penalty=2.5), "presence_penalty", None),
    (chat(logit_bias={"hello": 1}), "logit_bias", None),
    (chat(logit_bias={"5": 101}), "logit_bias", None),
    (chat(min_p=1.5), "min_p", None),
    (chat(repeat_penalty=0), "repeat_penalty", None),
    (chat(response_format={"type": "xml"}), "response_format.type", None),
    (chat(response_format={"type": "json_schema"}), "response_format", None),
    (chat(temperature=2.5), "temperature", None),
    (chat(top_p=0), "top_p", None),
    (chat(top_k=-1), "top_k", None),
    (chat(seed=-3), "seed", None),
    (chat(max_tokens=0), "max_tokens", None),
    (chat(max_tokens=MAX_TOKENS + 1), "max_tokens", "invalid_value"),
    (chat(max_tokens=4, max_completion_tokens=5), "body", None),
    (chat(stop=["a"] * 33), "stop", None),
    (chat(stream_options={"include_usage": True}), "body", None),
    ({"model": MODEL}, "messages", "missing_field"),
    ({"model": MODEL, "messages": []}, "messages", None),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "model_not_multimodal"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0", None),
    ([1, 2, 3], "body", None),
])
def test_bad_fields_are_400_naming_the_field(client, body, param, code):
    assert_error(client.post("/v1/chat/completions", json=body), 400, "invalid_request_error", code, param)


def test_malformed_json_is_400(client):
    response = client.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', 
                           headers={"Content-Type": "application/json"})
    assert_error(response, 400, "invalid_request_error", "invalid_json")
    nan = client.post("/v1/chat/completions", content=b'{"model": "%s", "messages": [{"role": "user", "content": '
                      b'"x"}], "temperature": NaN}' % MODEL.encode(), headers={"Content-Type": "application/json"})
    assert_error(nan, 400, "invalid_request_error", param="temperature")


def test_prompt_longer_than_the_context_is_400_exceed_context_size(client):
    error = assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 1000}), 400,
                         "exceed_context_size_error", "context_length_exceeded")
    assert error["n_ctx"] == N_CTX and error["n_prompt_tokens"] == 1001


def test_too_large_prompt_and_body_are_413(client):
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_PROMPT_BYTES + 1)}),
                 413, "invalid_request_error", "prompt_too_large")
    huge = b'{"model": "x", "prompt": "' + b"y" * 200_000 + b'"}'  # over 6 x --max-prompt-bytes + 64 KiB
    assert_error(client.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"}),
                 413, "invalid_request_error", "request_too_large")


def test_any_model_name_is_served_and_unknown_route_404_and_wrong_method_405(client):
    """A one-model server serves whatever name a script sends (llama-server does); --strict-model-name 404s
    (test_serve_clients)."""
    reply = client.post("/v1/chat/completions", json=chat(model="gpt-4o"))
    assert reply.status_code == 200 and reply.json()["model"] == "gpt-4o", reply.text
    assert_error(client.get("/v1/nothing"), 404, "not_found_error")
    assert_error(client.get("/v1/chat/completions"), 405, "invalid_request_error")


def test_api_key_is_required_everywhere_but_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for path in ("/ready", "/v1/models", "/metrics", "/status", "/openapi.json"):
            response = anonymous.get(path)
            assert_error(response, 401, "authentication_error", "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer " + "x" * len(server.api_key)})
        assert_error(wrong, 401, "authentication_error")
        assert_error(anonymous.post("/v1/chat/completions", json=chat(), headers={"Authorization": server.api_key}),
                     401, "authentication_error")
        assert anonymous.get("/v1/models", headers=server.headers).status_code == 200
        assert "access-control-allow-origin" not in anonymous.get(
            "/health", headers={"Origin": "http://evil.example"}).headers  # CORS is off


def test_bad_requests_do_not_disturb_a_running_one(client):
    body = {"model": MODEL, "prompt": "steady", "max_tokens": MAX_TOKENS, "temperature": 0}
    alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        texts = []
        for line in lines:
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 2:
                    for bad in (chat(temperature=-1), {"model": MODEL, "prompt": "x" * 1000}, [None]):
                        assert client.post("/v1/completions", json=bad).status_code == 400
    assert "".join(texts) == alone


def test_metrics_use_homepd_names_in_base_units(client):
    client.post("/v1/chat/completions", json=chat())
    text = client.get("/metrics").text
    samples = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all(name.startswith("homepd_") for name in samples), samples
    for name in ("homepd_time_to_first_token_seconds_count", "homepd_inter_token_latency_seconds_bucket",
                 "homepd_e2e_request_latency_seconds_sum", "homepd_request_queue_seconds_count",
                 "homepd_prompt_tokens_total", "homepd_generation_tokens_total", "homepd_num_requests_running",
                 "homepd_num_requests_waiting", "homepd_worker_restarts_total", "homepd_worker_up", "homepd_ready",
                 "homepd_requests_total", "homepd_requests_rejected_total", "homepd_process_memory_bytes"):
        assert name in samples, name


def test_status_and_event_stream(server, client):
    status = client.get("/status").json()
    assert status["state"] == "ready" and status["engine"]["mode"] == "colocated"
    assert status["engine"]["workers"][0]["ready"] is True
    with client.stream("GET", "/events", params={"interval_s": 0.2}) as events:
        lines = events.iter_lines()
        assert next(lines) == "event: steps" and "n_steps" in json.loads(next(lines)[6:]) and next(lines) == ""
        assert next(lines) == "event: snapshot"
        snapshot = json.loads(next(lines)[len("data: "):])
        assert snapshot["state"] == "ready" and "engine" in snapshot
        rid = client.post("/v1/chat/completions", json=chat()).json()["id"]
        kind = None
        for line in lines:
            if line.startswith("event: "):
                kind = line[7:]
            elif kind == "request" and line.startswith("data: ") and json.loads(line[6:])["request_id"] == rid:
                break
    assert any(r["request_id"] == rid for r in client.get("/status").json()["recent_requests"])


def _openapi_schema():
    """The service's OpenAPI document, built in-process (no engine): the fuzz target's contract."""
    from homepd.config import EngineConfig
    from homepd.serve.app import create_app
    from homepd.serve.service import Service
    from homepd.serve.settings import ServeSettings

    doc = create_app(Service(EngineConfig(backend="fake"), ServeSettings(embedding_model="all-minilm-l6-v2"))).openapi()
    return schemathesis.openapi.from_dict(doc).exclude(path="/events")  # an endless stream by design


# why the new rooms out of the positive run: their valid bodies run the engine (seconds of the suite's budget),
# and tests/integration/test_ollama_api.py drives them; the negative run below covers them
SCHEMA = _openapi_schema().exclude(path_regex=r"^/api/|^/v1/embeddings$|^/$")
# the routes that take input (a GET has none to break; nor has POST /advice/evaluate)
NEGATIVE_SCHEMA = _openapi_schema().include(method="POST").exclude(path="/advice/evaluate")
NEGATIVE_SCHEMA.config.generation.update(modes=[GenerationMode.NEGATIVE])


@SCHEMA.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_finds_no_server_error(case, server):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # past the model check, so the fuzzed fields reach the engine
    case.call_and_validate(base_url=server.url, headers=server.headers, checks=[not_a_server_error], timeout=30)


@NEGATIVE_SCHEMA.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_negative_fuzz_finds_no_server_error(case, server):
    """Bodies, queries and headers that break the schema (wrong types, missing fields, out of range)."""
    assert case.meta.generation.mode is GenerationMode.NEGATIVE
    case.call_and_validate(base_url=server.url, headers=server.headers, checks=[not_a_server_error], timeout=30)
