"""The Ollama API and the embeddings over real HTTP, driven by the official ``ollama`` client (the library Home
Assistant uses), on the fake backend: the routes' logic, Home Assistant's setup and polling path, Open WebUI's
verify -> list -> ps -> chat -> eject sequence, parallel embedding batches, and bad input.  The real models run
each client path once in ``test_ollama_real.py``."""
from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from test_serve_harness import ServeProcess

CHAT = "smollm2-135m-instruct-q4_1"
EMBED = "all-minilm-l6-v2"
TAGS_TIMEOUT_S = 5.0  # Home Assistant's timeout on /api/tags and /api/ps


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The server as soon as its process runs (not yet ready: the first test watches it load)."""
    proc = ServeProcess(tmp_path_factory.mktemp("ollama"), "--backend", "fake", "--n-ctx", "1024",
                        "--embedding-model", EMBED, "--max-embedding-inputs", "32", "--no-advice")
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def server(started):
    return started.wait_ready()


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, headers=server.headers)


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c


def test_home_assistant_polls_tags_within_5_s_also_while_the_model_loads(started):
    """HA's setup: GET /api/tags (5 s timeout) answers from the first moment the port does, loading or not."""
    seen_loading = seen_ready = False
    with started.client(timeout=TAGS_TIMEOUT_S) as c:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not seen_ready:
            try:
                t0 = time.monotonic()
                tags = c.get("/api/tags")
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            assert tags.status_code == 200 and time.monotonic() - t0 < TAGS_TIMEOUT_S
            assert {m["name"] for m in tags.json()["models"]} == {f"{CHAT}:latest", f"{EMBED}:latest"}
            ready = c.get("/ready").status_code == 200
            seen_loading |= not ready
            seen_ready |= ready
    assert seen_loading and seen_ready


def test_version_root_list_show_and_ps(client, http):
    assert re.fullmatch(r"\d+\.\d+\.\d+", http.get("/api/version").json()["version"])
    assert http.get("/").text == "Ollama is running" and http.head("/").status_code == 200
    models = {m.model: m for m in client.list().models}
    chat = models[f"{CHAT}:latest"]
    assert chat.details.format == "gguf" and chat.details.quantization_level == "Q4_1" and chat.size > 0
    assert chat.digest and chat.modified_at is not None and chat.details.parameter_size.endswith("M")
    show = client.show(CHAT)
    assert show.capabilities == ["completion", "tools"] and "num_ctx 1024" in show.parameters
    assert show.modelinfo["fake.context_length"] > 0 and show.template
    assert client.show(EMBED).capabilities == ["embedding"]
    legacy = http.post("/api/show", json={"name": f"{CHAT}:latest"})  # Continue's key
    assert legacy.status_code == 200 and legacy.json()["details"]["family"]
    loaded = {m.model: m for m in client.ps().models}
    assert loaded[f"{CHAT}:latest"].context_length == 1024 and loaded[f"{CHAT}:latest"].size_vram == 0
    assert loaded[f"{CHAT}:latest"].expires_at.year > 2100  # the chat model stays while the service runs
    served = {m["name"]: (m["role"], m["state"]) for m in http.get("/status").json()["served_models"]}  # the app's
    assert served[f"{CHAT}:latest"] == ("chat", "loaded") and served[f"{EMBED}:latest"][0] == "embedding"


def test_chat_streamed_equals_chat_whole_and_ends_with_the_counts(client):
    messages = [{"role": "user", "content": "hello"}]
    options = {"temperature": 0, "num_predict": 6}
    whole = client.chat(CHAT, messages=messages, options=options)
    chunks = list(client.chat(CHAT, messages=messages, options=options, stream=True))
    assert "".join(c.message.content for c in chunks) == whole.message.content and len(whole.message.content) == 6
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    for last in (whole, chunks[-1]):
        assert last.done_reason == "length" and last.eval_count == 6 and last.prompt_eval_count > 0
        assert isinstance(last.total_duration, int) and last.total_duration >= last.eval_duration > 0


def test_generate_with_options_is_repeatable_and_raw_is_a_completion(client):
    options = {"num_predict": 5, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 42,
               "repeat_penalty": 1.1, "stop": ["\n\n"], "mirostat": 0}
    a = client.generate(CHAT, prompt="Once upon", options=options)
    b = client.generate(CHAT, prompt="Once upon", options=options)
    assert a.response == b.response and a.eval_count == 5 and a.done_reason == "length"
    raw = client.generate(CHAT, prompt="Once upon", raw=True, options={"num_predict": 3})
    assert raw.prompt_eval_count < a.prompt_eval_count  # no chat template around it


def test_format_with_a_schema_is_valid_json_of_that_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat(CHAT, messages=[{"role": "user", "content": "a person"}], format=schema,
                        options={"num_predict": 64})
    jsonschema.validate(json.loads(reply.message.content), schema)
    assert json.loads(client.generate(CHAT, prompt="json", format="json", options={"num_predict": 64}).response) \
        is not None


def test_home_assistant_streams_a_tool_chat_with_keep_alive_and_num_ctx_then_sends_the_result(client):
    """HA's request: tools, stream, keep_alive "-1s", options.num_ctx 8192 (above the loaded context: served by
    the loaded one, no reload); then its history with the call's arguments as an object and the tool's
    result without tool_name."""
    tools = [{"type": "function", "function": {"name": "HassTurnOn", "description": "turn on a device",
                                               "parameters": {"type": "object", "properties": {
                                                   "name": {"type": "string"}}, "required": ["name"]}}}]
    history = [{"role": "system", "content": "You control a home."}, {"role": "user", "content": "light on"}]
    chunks = list(client.chat(CHAT, messages=history, tools=tools, stream=True, keep_alive="-1s",
                              options={"num_ctx": 8192, "num_predict": 64}))
    assert chunks[-1].done and chunks[-1].done_reason in ("stop", "length")
    history += [{"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}}]},
                {"role": "tool", "content": json.dumps({"success": True})}]
    after = list(client.chat(CHAT, messages=history, tools=tools, stream=True, keep_alive=-1,
                             options={"num_ctx": 8192, "num_predict": 16}))
    assert after[-1].done


def test_open_webui_verifies_lists_checks_ps_chats_and_ejects(http):
    assert re.fullmatch(r"\d+(\.\d+)*", http.get("/api/version").json()["version"])
    names = [m["name"] for m in http.get("/api/tags").json()["models"]]
    assert f"{CHAT}:latest" in names
    expires = http.get("/api/ps").json()["models"][0]["expires_at"]
    assert time.strptime(expires[:19], "%Y-%m-%dT%H:%M:%S") and expires[19:] in ("+00:00", "Z")
    with http.stream("POST", "/api/chat", json={"model": f"{CHAT}:latest", "messages": [
            {"role": "user", "content": "hi"}], "options": {"num_predict": 4}}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and all(not x["done"] for x in lines[:-1])
    eject = http.post("/api/generate", json={"model": f"{CHAT}:latest", "keep_alive": 0, "prompt": ""})
    assert eject.status_code == 200 and eject.json()["done_reason"] == "unload"


def test_embed_a_batch_and_a_single_string_normalised(client):
    batch = client.embed(EMBED, input=["The cat is sleeping on the sofa.", "A cat naps on the couch.",
                                       "Share prices dropped today."])
    vectors = np.array(batch.embeddings)
    assert vectors.shape == (3, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    one = client.embed(EMBED, input="A cat naps on the couch.")
    assert np.allclose(one.embeddings[0], vectors[1], atol=1e-6) and one.prompt_eval_count > 0
    assert len(client.embed(EMBED, input="x", dimensions=64).embeddings[0]) == 64
    legacy = client.embeddings(EMBED, prompt="A cat naps on the couch.")
    assert np.allclose(legacy.embedding, vectors[1], atol=1e-6)


def test_load_and_unload_through_keep_alive(client):
    assert client.generate(EMBED, keep_alive=0).done_reason == "unload"
    assert EMBED + ":latest" not in [m.model for m in client.ps().models]
    assert client.embed(EMBED, input=[], keep_alive="10m").embeddings == []  # an empty input loads it
    loaded = {m.model: m for m in client.ps().models}[EMBED + ":latest"]
    assert 500 < (loaded.expires_at.timestamp() - time.time()) <= 600
    assert client.chat(CHAT, messages=[]).done_reason == "load"
    assert client.chat(CHAT, messages=[], keep_alive=0).done_reason == "unload"
    assert client.generate(EMBED, keep_alive=0).done_reason == "unload"


def test_eight_parallel_openai_embedding_batches_of_16_are_all_answered(server):
    def batch(i: int) -> httpx.Response:
        with server.client() as c:
            return c.post("/v1/embeddings", json={"model": "text-embedding-3-small",
                                                  "input": [f"document {i} chunk {j}" for j in range(16)]})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(batch, range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    body = responses[0].json()
    assert [d["index"] for d in body["data"]] == list(range(16)) and body["usage"]["prompt_tokens"] > 0


def test_openai_embeddings_take_token_arrays_base64_and_dimensions(http):
    floats = http.post("/v1/embeddings", json={"model": EMBED, "input": "hello world"}).json()["data"][0]
    b64 = http.post("/v1/embeddings", json={"model": EMBED, "input": ["hello world"],
                                            "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(b64), "<f4"), floats["embedding"], atol=1e-7)
    tokens = http.post("/v1/embeddings", json={"model": EMBED, "input": [[101, 2000, 102], [101, 102]],
                                               "dimensions": 8}).json()
    assert [len(d["embedding"]) for d in tokens["data"]] == [8, 8] and tokens["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("path, body, status, message", [
    ("/api/chat", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}, 404, "model 'x' not found"),
    ("/api/show", {"model": "nope:7b"}, 404, "model 'nope:7b' not found"),
    ("/api/embed", {"model": "x", "input": "hi"}, 404, "model 'x' not found"),
    ("/api/chat", {"model": CHAT, "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"model": CHAT, "stream": "yes"}, 400, "stream"),
    ("/api/chat", {"model": CHAT, "messages": [], "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {"model": CHAT, "messages": [], "keep_alive": "soon"}, 400, "keep_alive"),
    ("/api/chat", {"model": CHAT, "think": True, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "does not support thinking"),
    ("/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
     "text-only model"),
    ("/api/generate", {"model": CHAT, "prompt": "x", "images": ["aGk="]}, 400, "text-only model"),
    ("/api/chat", {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}, 400, "does not support chat"),
    ("/api/embed", {"model": CHAT, "input": "hi"}, 400, "is a chat model"),
    ("/v1/embeddings", {"model": CHAT, "input": "hi"}, 400, "is a chat model"),
    ("/v1/chat/completions", {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "is an embedding model"),
    ("/api/embed", {"model": EMBED, "input": ["x"] * 33}, 413, "at most 32"),
    ("/v1/embeddings", {"model": EMBED, "input": ["x"] * 33}, 413, "at most 32"),
    ("/api/embed", {"model": EMBED, "input": "word " * 600, "truncate": False}, 400, "context is 512 tokens"),
    ("/v1/embeddings", {"model": EMBED, "input": [[101, 99999]]}, 400, "not in the model's vocabulary"),
    ("/api/pull", {"model": "no-such-model"}, 404, "not found"),
    ("/api/delete", {"model": CHAT}, 501, "does not delete models"),
    ("/api/create", {"model": "m", "from": CHAT}, 501, "--model"),
])
def test_bad_input_gets_a_clear_error_in_the_routes_shape(http, path, body, status, message):
    response = http.request("DELETE" if path == "/api/delete" else "POST", path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    text = error if path.startswith("/api/") else error["message"]  # Ollama's shape under /api/, else OpenAI's
    assert message in text, text


def test_a_long_input_is_cut_to_the_context_by_default(client):
    assert client.embed(EMBED, input="word " * 600).prompt_eval_count == 512


def test_malformed_json_and_a_wrong_key_are_ollama_shaped(server):
    with httpx.Client(base_url=server.url) as c:
        assert c.post("/api/chat", content=b"{", headers={**server.headers, "content-type": "application/json"}
                      ).json()["error"]
        no_key = c.get("/api/tags")  # the API key's 401, in Ollama's shape (HA names it an auth failure)
        assert no_key.status_code == 401 and "API key" in no_key.json()["error"]
