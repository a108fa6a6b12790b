"""The Ollama face's pure parts: keep_alive durations, options onto the sampler, messages onto the OpenAI
shape the chat plan reads (tool calls with ids, results matched to them), format and think, the error shape."""
from __future__ import annotations

import json

import pytest

from homepd.engine.embedder import DEFAULT
from homepd.models.card import ModelCard
from homepd.serve.errors import APIError
from homepd.serve.ollama.errors import ollama_body
from homepd.serve.ollama.mapping import chat_body, generate_body, sampling
from homepd.serve.ollama.schemas import ChatRequest, GenerateRequest, Options, keep_alive_seconds
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

CHAT_CARD = ModelCard(name="smollm2:latest", spec="smollm2", role="chat", path="/m/smollm2.gguf",
                      template="{{ messages }}", capabilities=("completion", "tools"))
THINKER = ModelCard(name="qwen3:latest", spec="qwen3", role="chat", path="/m/q.gguf", template="<think>",
                    capabilities=("completion", "tools", "thinking"))
BASE = ModelCard(name="gemma:latest", spec="gemma", role="chat", path="/m/g.gguf", template=None,
                 capabilities=("completion", "tools"))


@pytest.mark.parametrize("value, seconds", [
    (None, DEFAULT), (300, 300.0), (0, 0.0), (-1, None), ("5m", 300.0), ("1h30m", 5400.0), ("-1s", None),
    ("0", 0.0), ("90", 90.0), ("250ms", 0.25), ("-1", None), (2.5, 2.5)])
def test_keep_alive_is_seconds_none_for_good_or_default(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", "", "1d"])
def test_a_keep_alive_that_is_no_duration_says_what_one_looks_like(value):
    with pytest.raises(ValueError, match="not a duration.*Go duration"):
        keep_alive_seconds(value)


def test_options_map_onto_the_sampler_and_unknown_ones_are_listed():
    options = Options.model_validate({"num_predict": 12, "temperature": 0.2, "top_k": 5, "top_p": 0.5,
                                      "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": -1, "seed": 7,
                                      "stop": ["\n\n"], "num_ctx": 8192, "mirostat": 2, "tfs_z": 1.0})
    assert sampling(options) == {"temperature": 0.2, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1,
                                 "repeat_last_n": -1, "max_tokens": 12, "seed": 7, "stop": ["\n\n"]}
    assert sorted(options.ignored_fields()) == ["mirostat", "tfs_z"]
    assert sampling(Options(num_predict=-1, seed=-1)) == {}  # until done; a random seed


def test_a_tool_call_with_object_arguments_and_a_result_without_tool_name_reach_the_plan_as_openai_messages():
    body = ChatRequest.model_validate({"model": "smollm2", "messages": [
        {"role": "user", "content": "light on"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen", "brightness": 80}}}]},
        {"role": "tool", "content": "{\"success\": true}"},
        {"role": "user", "content": "thanks"}],
        "tools": [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {"type": "object"}}}],
        "options": {"num_ctx": 8192}, "keep_alive": -1, "stream": True})
    openai = chat_body(body, CHAT_CARD)
    assert isinstance(openai, ChatCompletionRequest) and not openai.stream
    call = openai.messages[1].tool_calls[0]
    assert call.id == "call_1" and json.loads(call.function.arguments) == {"name": "kitchen", "brightness": 80}
    assert openai.messages[2].role == "tool" and openai.messages[2].tool_call_id == "call_1"


def test_tool_results_match_their_calls_by_id_then_by_name_then_in_order():
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}},
                                             {"function": {"name": "g", "arguments": {}}},
                                             {"function": {"name": "h", "arguments": {}}}]},
        {"role": "tool", "content": "g's", "tool_name": "g"},
        {"role": "tool", "content": "a's", "tool_call_id": "a"},
        {"role": "tool", "content": "h's"}]})
    ids = [m.tool_call_id for m in chat_body(body, CHAT_CARD).messages[1:]]
    assert ids == ["call_2", "a", "call_3"]


def test_a_tool_result_answering_nothing_is_a_400_naming_the_message():
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(APIError, match=r"messages\[0\] is a tool result that answers no earlier tool call"):
        chat_body(body, CHAT_CARD)


def test_format_think_and_images():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "format": schema, "think": "high"})
    openai = chat_body(body, THINKER)
    assert openai.response_format.type == "json_schema" and openai.response_format.json_schema.schema_ == schema
    assert openai.chat_template_kwargs == {"enable_thinking": True} and openai.reasoning_effort == "high"
    assert chat_body(ChatRequest.model_validate({"model": "m", "format": "json", "think": False,
                                                 "messages": [{"role": "user", "content": "x"}]}),
                     CHAT_CARD).response_format.type == "json_object"
    with pytest.raises(APIError, match="'smollm2:latest' does not support thinking"):
        chat_body(body, CHAT_CARD)
    images = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x",
                                                                     "images": ["aGk="]}]})
    with pytest.raises(APIError, match=r"messages\[0\].images: smollm2:latest is a text-only model") as e:
        chat_body(images, CHAT_CARD)
    assert e.value.status == 400 and e.value.code == "model_not_multimodal"


def test_generate_is_a_chat_turn_unless_raw_or_the_model_has_no_template():
    turn = generate_body(GenerateRequest.model_validate({"model": "m", "prompt": "hi", "system": "be brief"}),
                         CHAT_CARD)
    assert isinstance(turn, ChatCompletionRequest) and [m.role for m in turn.messages] == ["system", "user"]
    raw = generate_body(GenerateRequest.model_validate({"model": "m", "prompt": "hi", "raw": True}), CHAT_CARD)
    assert isinstance(raw, CompletionRequest) and raw.prompt == "hi"
    assert isinstance(generate_body(GenerateRequest(model="m", prompt="hi"), BASE), CompletionRequest)
    with pytest.raises(APIError, match="'m' does not support insert"):
        generate_body(GenerateRequest(model="m", prompt="def f(", suffix="return 1"), CHAT_CARD)


def test_an_error_body_is_rewritten_to_ollamas_shape_and_anything_else_is_kept():
    openai = APIError(404, "model 'x' not found", code="model_not_found").body()
    assert json.loads(ollama_body(json.dumps(openai).encode())) == {"error": "model 'x' not found"}
    assert ollama_body(b"not json") == b"not json"
    assert ollama_body(b'{"error": "already"}') == b'{"error": "already"}'
