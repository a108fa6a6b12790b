"""From an OpenAI request to the engine's chat plan: the mapping of a body onto ``plan_chat``'s arguments, and
the 400s.

``plan_request`` reads a validated body once: the messages as plain dicts, the tools and the tool choice, the
structured output asked for (``response_format``, llama-server's ``json_schema`` and ``grammar``), the
template's kwargs; the plan itself (the template's messages, the grammar, the reply parser's settings) is the
engine layer's one ``homepd.engine.chatplan.plan_chat``, which the app's chat tester calls too.  Building a
grammar from a schema is bounded (``homepd.structured.limits``) and runs off the event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from starlette.concurrency import run_in_threadpool

from homepd.chat.format import ChatFormat, ToolChoice, ToolSpec
from homepd.chat.parser import ReplyParser
from homepd.core.sampling import SamplingParams
from homepd.engine.chatplan import RESPONSE_SCHEMA_PATH, ChatPlan, Output, plan_chat, plan_completion
from homepd.engine.prompt import ChatExtras
from homepd.errors import RequestError
from homepd.serve.errors import APIError
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

# parts a text-only model cannot take, by OpenAI's (and vLLM's) part types
MEDIA_PARTS = {"image_url": "an image", "input_image": "an image", "image": "an image", "input_audio": "audio",
               "audio_url": "audio", "video_url": "a video", "file": "a file", "input_file": "a file"}


@dataclass(frozen=True)
class RequestPlan:
    """What one request runs: the engine's chat plan and the sampling parameters with its grammar."""
    plan: ChatPlan
    params: SamplingParams

    @property
    def prompt(self) -> str | None:
        return self.plan.prompt

    @property
    def messages(self) -> list[dict] | None:
        return self.plan.messages

    @property
    def chat(self) -> ChatExtras | None:
        return self.plan.chat

    @property
    def tools_active(self) -> bool:
        return self.plan.tools_active

    def parser(self) -> ReplyParser | None:
        return self.plan.parser()


def check_parts(body: ChatCompletionRequest, model_name: str) -> None:
    """A text-only model gets text parts only: another part is a 400 naming it (``model_not_multimodal``)."""
    for i, m in enumerate(body.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type == "text":
                continue
            where = f"messages[{i}].content[{j}]"
            if part.type in MEDIA_PARTS:
                raise APIError(400, f"{where} is {MEDIA_PARTS[part.type]} ({part.type!r} part), and {model_name} "
                                    "is a text-only model: it has no vision or audio input; send text parts only",
                               code="model_not_multimodal", param=where)
            raise APIError(400, f"{where}: unknown content part type {part.type[:40]!r} (a text-only model takes "
                                "'text' parts)", code="invalid_value", param=where)


async def plan_request(body: ChatCompletionRequest | CompletionRequest, params: SamplingParams,
                       chat_format: ChatFormat, model_name: str) -> RequestPlan:
    """The plan for ``body`` (``params``: its sampling without a grammar); APIError 400 for what cannot run."""
    try:
        output = _output(body)
        if isinstance(body, CompletionRequest):
            plan = await run_in_threadpool(plan_completion, body.prompt_text(), output)
        else:
            check_parts(body, model_name)
            tools = ToolSpec.parse_all(body.tools or [])
            kwargs = dict(body.chat_template_kwargs or {})
            if body.reasoning_effort is not None:
                kwargs.setdefault("reasoning_effort", body.reasoning_effort)
            plan = await run_in_threadpool(
                plan_chat, chat_format, [_message(m) for m in body.messages], tools=tools,
                choice=ToolChoice.parse(body.tool_choice, tools), parallel=body.parallel_tool_calls is True,
                output=output, template_kwargs=kwargs or None)
        return RequestPlan(plan, replace(params, grammar=plan.grammar))
    except RequestError as exc:
        raise APIError(400, str(exc), code=getattr(exc, "code", None) or "invalid_value",
                       param=getattr(exc, "param", None)) from None


def _message(m) -> dict:
    """A validated message as the plain dict ``template_messages`` takes (reasoning is not sent back)."""
    text = m.text()
    # why "" for a missing content: no content is an empty message (an assistant's with tool calls stays None)
    out: dict = {"role": "system" if m.role == "developer" else m.role,
                 "content": text if text is not None or m.tool_calls else ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _output(body) -> Output:
    """The structured output a body asks for: llama-server's ``grammar``, ``response_format`` (json_schema, or
    json_object with or without a schema) or llama-server's ``json_schema`` field."""
    if body.grammar:  # why not "is not None": an empty grammar is none, to llama.cpp and llama-server alike
        return Output(gbnf=body.grammar)
    rf = body.response_format
    if rf is not None and rf.type == "json_schema":
        return Output(schema=rf.json_schema.schema_, schema_path=RESPONSE_SCHEMA_PATH)
    if rf is not None and rf.type == "json_object":
        return Output(json_object=True) if rf.schema_ is None else \
            Output(schema=rf.schema_, schema_path="response_format.schema")
    if body.json_schema is not None:
        return Output(schema=body.json_schema, schema_path="json_schema")
    return Output()


def arguments_json(arguments: str) -> str:
    """A tool call's arguments as OpenAI sends them: a JSON string (compact when it parses)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return arguments
