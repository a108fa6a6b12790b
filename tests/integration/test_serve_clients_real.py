"""Real clients against ``homepd serve`` on the real SmolLM2-135M: the grammar, not the fake, makes every
structured answer and every tool call well-formed.  Home Assistant's setup call exactly as its ``llama_cpp``
integration sends it, a tool round trip streamed and not, structured output at temperature 1.0 validated with
``jsonschema``, and one run of each client library (``client_libraries``).  The 50-sample version of the
structured-output check is ``benchmarks/structured_output.py``."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import client_libraries
from structured_schemas import SCHEMAS
from test_serve_harness import ServeProcess

MODEL = client_libraries.MODEL
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("clients-real"), "--n-ctx", "4096", "--no-advice")
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def sdk(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0) as client:
        yield client


def test_home_assistant_setup_call_passes_non_streamed_then_streamed(sdk):
    """homeassistant/components/llama_cpp: a test_function tool with empty object parameters, max_tokens 3."""
    tool = {"type": "function", "function": {"name": "test_function", "description": "",
                                             "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "test"}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(sdk, stream):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with sdk.chat.completions.stream(model=MODEL, messages=question, tools=[WEATHER], tool_choice="required",
                                         max_tokens=64) as s:
            first = s.get_final_completion()
    else:
        first = sdk.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], tool_choice="required",
                                            max_tokens=64)
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    history = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    kwargs = dict(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=48)
    if stream:
        chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    else:
        message = sdk.chat.completions.create(**kwargs).choices[0].message
        answer = message.content
        assert not message.tool_calls
    assert answer.strip(), "the model answered nothing after the tool's result"


@pytest.mark.parametrize("name", SCHEMAS)
def test_structured_output_at_temperature_one_always_validates(sdk, name):
    schema = SCHEMAS[name]
    for seed in range(2):  # two samples per schema here; 50 in benchmarks/structured_output.py
        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a {name} as JSON."}], temperature=1.0,
            seed=seed, max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_sdk_parse_with_a_pydantic_model(sdk):
    # Greedy SmolLM2 fills every string of this Person with "1000…"; its maxLength bounds them, so the object
    # closes in ~60 tokens, well inside max_tokens.
    reply = sdk.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Alice, 30, 1 Main St, "
                                                                                          "Springfield."}],
                                       response_format=client_libraries.Person, max_tokens=256, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, client_libraries.Person)


def test_openai_agents_on_the_real_model(server):
    cities, answer = client_libraries.openai_agents_tool_run(server.url + "/v1", server.api_key)
    assert len(cities) == 1 and answer == f"sunny in {cities[0]}"


def test_pydantic_ai_on_the_real_model(server):
    assert isinstance(client_libraries.pydantic_ai_structured(server.url + "/v1", server.api_key),
                      client_libraries.Person)


def test_instructor_on_the_real_model(server):
    assert isinstance(client_libraries.instructor_nested(server.url + "/v1", server.api_key), client_libraries.Person)


def test_langchain_on_the_real_model(server):
    calls, person = client_libraries.langchain_flows(server.url + "/v1", server.api_key)
    assert [c["name"] for c in calls] == ["get_time"] and isinstance(calls[0]["args"]["timezone"], str)
    assert isinstance(person, client_libraries.Person)
