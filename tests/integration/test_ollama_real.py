"""The Ollama API and the embeddings on the real models, once per client path: SmolLM2-135M for chat (its
grammar, not the fake, makes the tool call and the schema's JSON) and all-minilm-l6-v2, converted at pull time,
for embeddings.  The official ``ollama`` client throughout; Home Assistant's tool chat and Open WebUI's
sequence as they send them.  The logic of each route is tested on the fake backend (``test_ollama_api.py``)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import ollama
import pytest

from homepd.models.resolve import resolve_model
from test_serve_harness import ServeProcess

CHAT = "smollm2-135m-instruct-q4_1"
EMBED = "all-minilm-l6-v2"
HASS_TURN_ON = {"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on/opens a device",
                                                 "parameters": {"type": "object", "properties": {
                                                     "name": {"type": "string"}}, "required": ["name"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    resolve_model(EMBED, progress=False)  # pulled (and converted) the first time, like the chat model
    proc = ServeProcess(tmp_path_factory.mktemp("ollama-real"), "--n-ctx", "4096", "--no-advice",
                        "--embedding-model", EMBED)
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, headers=server.headers)


def test_list_show_and_ps_read_the_ggufs(client):
    assert {m.model for m in client.list().models} == {f"{CHAT}:latest", f"{EMBED}:latest"}
    chat, embed = client.show(CHAT), client.show(EMBED)
    assert chat.modelinfo["llama.context_length"] == 8192 and chat.modelinfo["llama.embedding_length"] == 576
    assert embed.modelinfo["bert.context_length"] == 512 and embed.modelinfo["bert.embedding_length"] == 384
    assert 'stop "<|im_end|>"' in chat.parameters and "{%" in chat.template
    assert embed.capabilities == ["embedding"] and embed.details.quantization_level == "F16"
    assert {m.model: m.context_length for m in client.ps().models}[f"{CHAT}:latest"] == 4096


def test_home_assistant_streamed_tool_chat_gives_object_arguments_then_takes_the_result(client):
    history = [{"role": "system", "content": "You are a voice assistant for Home Assistant."},
               {"role": "user", "content": "Please turn on the light named kitchen."}]
    chunks = list(client.chat(CHAT, messages=history, tools=[HASS_TURN_ON], stream=True, keep_alive="-1s",
                              options={"num_ctx": 8192, "temperature": 0, "num_predict": 64}))
    (calls,) = [c.message.tool_calls for c in chunks if c.message.tool_calls]
    assert calls[0].function.name == "HassTurnOn" and isinstance(calls[0].function.arguments["name"], str)
    assert chunks[-1].done and chunks[-1].done_reason == "stop" and chunks[-1].eval_count > 0
    history += [{"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "HassTurnOn", "arguments": dict(calls[0].function.arguments)}}]},
                {"role": "tool", "content": json.dumps({"success": True})}]  # as HA sends it: no tool_name
    after = client.chat(CHAT, messages=history, tools=[HASS_TURN_ON], keep_alive=-1,
                        options={"num_ctx": 8192, "temperature": 0, "num_predict": 48})
    assert after.done and (after.message.content or after.message.tool_calls)


def test_chat_streamed_and_whole_generate_with_options_and_a_schema(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat(CHAT, messages=messages, options={"temperature": 0, "num_predict": 12})
    streamed = list(client.chat(CHAT, messages=messages, stream=True, options={"temperature": 0, "num_predict": 12}))
    # why not equal: the second request reuses the first's cached prompt, and a near tie of greedy decoding can
    # fall the other way on the slightly different arithmetic
    assert whole.message.content and "".join(c.message.content for c in streamed)
    assert streamed[-1].eval_count == whole.eval_count == 12 and streamed[-1].done_reason == "length"
    options = {"num_predict": 16, "temperature": 0.9, "top_k": 30, "seed": 7, "repeat_penalty": 1.1}
    assert client.generate(CHAT, prompt="The sky is", options=options).response == \
        client.generate(CHAT, prompt="The sky is", options=options).response
    # why maxLength: at temperature 1 an unbounded string may run to num_predict (once: "</li></li>..." for 256
    # tokens); bounded, the grammar must close it, which is what this asserts
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = client.chat(CHAT, messages=[{"role": "user", "content": "The largest city in France?"}], format=schema,
                        options={"temperature": 1.0, "num_predict": 256})
    assert reply.done_reason == "stop", reply  # the grammar closed the object (not cut by num_predict)
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_embed_a_batch_and_a_string_on_the_converted_model(client):
    texts = ["The cat is sleeping on the sofa.", "A cat naps on the couch.", "Share prices dropped steeply."]
    v = np.array(client.embed(EMBED, input=texts).embeddings)
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert v[0] @ v[1] > 0.6 and v[0] @ v[2] < 0.2  # a paraphrase near, an unrelated sentence far
    assert np.allclose(client.embed(EMBED, input=texts[1]).embeddings[0], v[1], atol=1e-4)


def test_unload_and_load_through_keep_alive_and_parallel_openai_batches(client, server):
    assert client.generate(EMBED, keep_alive=0).done_reason == "unload"  # Open WebUI's eject
    assert f"{EMBED}:latest" not in {m.model for m in client.ps().models}
    assert client.embed(EMBED, input=[], keep_alive="1m").embeddings == []  # loads it
    assert f"{EMBED}:latest" in {m.model for m in client.ps().models}

    def batch(i: int):
        with server.client() as c:
            return c.post("/v1/embeddings", json={"model": EMBED, "input": [f"note {i}.{j} about the garden"
                                                                             for j in range(16)]})

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(batch, range(8)))
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert time.monotonic() - t0 < 60
