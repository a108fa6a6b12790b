"""Real clients against ``homepd serve`` (fake backend, real HTTP): the requests Home Assistant, Open WebUI,
Continue, SillyTavern and LibreChat send, through the official ``openai`` SDK; structured output, tool calls
streamed and not, log-probabilities, and the errors a client must be able to read.

The fake backend writes a grammar's shortest sentence (``homepd.fakellm``), so every structured answer here is
valid by construction: these tests prove the protocol (fields accepted, shapes returned, calls streamed by
index); ``test_serve_clients_real.py`` proves the same on SmolLM2, where the grammar does the work."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

import client_libraries
from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HA_TEST_TOOL = {"type": "function", "function": {"name": "test_function", "description": "Test function",
                                                 "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("clients"), "--backend", "fake", "--n-ctx", "8192",
                        "--max-tokens", "256")
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def sdk(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0) as client:
        yield client


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c


def user(text: str = "hello") -> list[dict]:
    return [{"role": "user", "content": text}]


# the requests of the clients' own code, each must be served ----------------------------------------------------
CLIENT_REQUESTS = {
    "home assistant setup (tools, max_tokens 3)": dict(messages=user("test"), tools=[HA_TEST_TOOL], max_tokens=3),
    "tools + tool_choice auto": dict(messages=user("weather in Paris?"), tools=[WEATHER], tool_choice="auto"),
    "tool history": dict(messages=[*user("weather in Paris?"), {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], tools=[WEATHER]),
    "json_schema strict": dict(messages=user("a person"), response_format={"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": {"type": "object", "properties": {"name": {"type": "string"}},
                                                     "required": ["name"], "additionalProperties": False}}}),
    "json_object": dict(messages=user("json please"), response_format={"type": "json_object"}),
    "unknown fields (Open WebUI, proxies)": dict(messages=user(), extra_body={
        "metadata": {"chat_id": "x"}, "keep_alive": "5m", "chat_template_kwargs": {"enable_thinking": False}}),
    "name on a message (LibreChat)": dict(messages=[{"role": "user", "content": "hi", "name": "alice"}]),
    "14 stop strings (Continue)": dict(messages=user(), stop=[f"\n{i}" for i in range(14)]),
    "penalties and logit_bias (SillyTavern)": dict(messages=user(), presence_penalty=0.6, frequency_penalty=0.4,
                                                   logit_bias={"50": -100}),
    "logprobs + top_logprobs": dict(messages=user(), logprobs=True, top_logprobs=5),
    "min_p, top_k, repeat_penalty (llama.cpp provider)": dict(messages=user(), extra_body={
        "min_p": 0.1, "top_k": 20, "repeat_penalty": 1.1, "repeat_last_n": 32}),
    "another model name": dict(messages=user(), model="gpt-4o-mini"),
    "temperature 0.7 top_p 0.9": dict(messages=user(), temperature=0.7, top_p=0.9, seed=3),
    "reasoning_effort": dict(messages=user(), extra_body={"reasoning_effort": "low"}),
}


@pytest.mark.parametrize("case", CLIENT_REQUESTS)
def test_every_client_shaped_request_is_served(sdk, case):
    kwargs = {"model": MODEL, "max_tokens": 24, **CLIENT_REQUESTS[case]}
    for stream in (False, True):
        if stream:
            chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls"), chunks[-1]
        else:
            reply = sdk.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls"), reply


def test_unknown_fields_are_listed_counted_and_refused_only_when_strict(http, tmp_path):
    body = {"model": MODEL, "messages": user(), "max_tokens": 2, "keep_alive": "5m",
            "metadata": {"a": 1}, "messages_extra": 1}
    body["messages"][0]["images"] = []
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert sorted(reply.json()["homepd"]["ignored_fields"]) == ["keep_alive", "messages[0].images", "messages_extra",
                                                                "metadata"]
    metrics = http.get("/metrics").text
    assert 'homepd_ignored_fields_total{field="keep_alive"}' in metrics
    strict = ServeProcess(tmp_path, "--backend", "fake", "--strict-fields", "--strict-model-name").wait_ready()
    try:
        with strict.client() as c:
            refused = c.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_field", refused.text
            other = c.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": user(), "max_tokens": 2})
            assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    finally:
        assert strict.terminate() == 0, strict.log()


def test_an_image_part_on_a_text_model_is_a_400_naming_the_part(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_multimodal" and error["param"] == "messages[0].content[1]"
    assert "vision" in error["message"] and "schema" not in error["message"]


# structured output ----------------------------------------------------------------------------------------------
class City(BaseModel):
    name: str
    population: int
    tags: list[str]


def test_sdk_parse_returns_the_pydantic_object(sdk):
    reply = sdk.chat.completions.parse(model=MODEL, messages=user("a city"), response_format=City, max_tokens=64)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City), reply


def test_a_grammar_cut_by_max_tokens_ends_with_length(http):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), "max_tokens": 3,
                                                     "response_format": {"type": "json_schema",
                                                                         "json_schema": {"schema": schema}}}).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["message"]["content"]) == 3  # the fake writes a byte a token


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 3}}}, "multipleOf"),
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
])
def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_keyword(http, schema, keyword):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert reply.status_code == 400, reply.text
    assert keyword in reply.json()["error"]["message"] and "properties.x" in reply.json()["error"]["message"]


def test_a_huge_schema_is_refused_fast_while_health_answers(http, server):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    started = time.monotonic()
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(),
                                                     "response_format": {"type": "json_schema",
                                                                         "json_schema": {"schema": schema}}})
    assert reply.status_code == 400, reply.text
    assert time.monotonic() - started < 5.0
    with server.client(timeout=2.0) as c:
        assert c.get("/health").status_code == 200


def test_grammar_and_json_schema_extensions(http):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), "max_tokens": 16,
                                                     "grammar": 'root ::= "yes" | "no"'}).json()
    assert reply["choices"][0]["message"]["content"] in ("yes", "no")
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 32,
                                               "json_schema": {"type": "object", "properties": {
                                                   "n": {"type": "integer", "minimum": 10, "maximum": 12}},
                                                   "required": ["n"]}}).json()
    assert 10 <= json.loads(reply["choices"][0]["text"])["n"] <= 12
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), "grammar": "root ::= ("})
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"], bad.text


# tool calls ----------------------------------------------------------------------------------------------------
def test_tool_choice_required_gives_a_call_of_that_tool(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=user("weather in Paris?"), tools=[WEATHER],
                                        tool_choice="required", max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_a_streamed_tool_call_accumulates_in_the_sdk_stream_helper(sdk):
    with sdk.chat.completions.stream(model=MODEL, messages=user("weather?"), tools=[WEATHER],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     max_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)


def test_streamed_call_deltas_carry_index_id_type_and_name_first(http):
    body = {"model": MODEL, "messages": user(), "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64,
            "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert rest and all(tc["index"] == 0 and "name" not in tc["function"] for tc in rest)
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls))["city"] is not None
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
])
def test_bad_tools_are_400s_naming_what_is_wrong(http, body, param):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), **body})
    assert reply.status_code == 400, reply.text
    assert param in reply.json()["error"]["message"], reply.json()


def test_a_tool_message_without_its_call_is_a_400(http):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        *user(), {"role": "tool", "tool_call_id": "call_missing", "content": "x"}], "tools": [WEATHER]})
    assert reply.status_code == 400 and "call_missing" in reply.json()["error"]["message"], reply.text


# log-probabilities ------------------------------------------------------------------------------------------------
def test_chat_logprobs_have_openai_shape(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=user(), max_tokens=4, logprobs=True, top_logprobs=3,
                                        temperature=0)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and bytes(e.bytes).decode() == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))  # greedy: the likeliest


def test_completion_logprobs_legacy_shape(http):
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 3, "logprobs": 2,
                                               "temperature": 0}).json()
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"] and all(len(t) == 2 for t in lp["top_logprobs"])


def test_models_states_the_sampling_defaults(http):
    model = http.get("/v1/models").json()["data"][0]
    assert model["meta"]["sampling_defaults"]["top_k"] == 40 and model["meta"]["sampling_defaults"]["min_p"] == 0.05
    assert http.get("/status").json()["sampling_defaults"] == model["meta"]["sampling_defaults"]


# the client libraries, unmodified ----------------------------------------------------------------------------------
def test_openai_agents_runs_a_tool_to_its_final_answer(server):
    cities, answer = client_libraries.openai_agents_tool_run(server.url + "/v1", server.api_key, 256)
    assert len(cities) == 1 and answer == f"sunny in {cities[0]}"


def test_pydantic_ai_gets_a_structured_result_through_its_output_tool(server):
    assert isinstance(client_libraries.pydantic_ai_structured(server.url + "/v1", server.api_key, 256),
                      client_libraries.Person)


def test_instructor_nested_response_model(server):
    person = client_libraries.instructor_nested(server.url + "/v1", server.api_key, 256)
    assert isinstance(person, client_libraries.Person) and isinstance(person.address, client_libraries.Address)


def test_langchain_bind_tools_and_with_structured_output(server):
    calls, person = client_libraries.langchain_flows(server.url + "/v1", server.api_key, 256)
    assert [c["name"] for c in calls] == ["get_time"] and set(calls[0]["args"]) == {"timezone"}
    assert isinstance(person, client_libraries.Person)


def test_tools_beside_a_response_format_give_a_call_or_an_answer_in_its_schema(http):
    """openai-agents sends both for an agent with tools and an output_type."""
    schema = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"],
              "additionalProperties": False}
    reply = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": user("weather?"), "tools": [WEATHER], "max_tokens": 128,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).json()
    message = reply["choices"][0]["message"]
    if message.get("tool_calls"):
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert set(json.loads(message["content"])) == {"summary"}, message


# as DeepSeek-R1's: an earlier answer's reasoning is cut off, and the generation prompt opens the block
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'].split('</think>')[-1] }}\n"
                     "{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


def test_reasoning_comes_apart_from_the_answer_with_its_own_first_token_time(tmp_path):
    """A template whose generation prompt opens a <think> block: the reply starts inside the reasoning.  The
    fake writes exactly what a grammar allows, so the reply here is 'weighing it</think>yes'."""
    proc = ServeProcess(tmp_path, "--backend", "fake", env={"HOMEPD_FAKE_CHAT_TEMPLATE": THINKING_TEMPLATE})
    try:
        proc.wait_ready()
        body = {"model": MODEL, "messages": user(), "grammar": 'root ::= "weighing it</think>yes"', "max_tokens": 64}
        with proc.client() as c:
            reply = c.post("/v1/chat/completions", json=body).json()
            message = reply["choices"][0]["message"]
            assert message["reasoning_content"] == "weighing it" and message["content"] == "yes", message
            assert reply["homepd"]["ttfa_s"] > reply["homepd"]["ttft_s"]
            with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                          if line.startswith("data: {") and json.loads(line[6:])["choices"]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == "weighing it"
            assert "".join(d.get("content") or "" for d in deltas) == "yes"
            assert "homepd_time_to_first_answer_seconds_count" in c.get("/metrics").text
    finally:
        assert proc.terminate() == 0, proc.log()
