"""From an OpenAI request to what the engine runs: messages for the template, tools, the grammar, the parser.

``plan_request`` reads a validated body once and returns a ``RequestPlan``:
the template's messages (tool calls and tool results in the shape the model's
template or the generic format wants, ``homepd.core.chatformat``), the
template's extras, the sampling parameters with their grammar (structured
output or tool calls, ``homepd.llm.grammar``), and how the reply is parsed back
into content, reasoning and tool calls.  Building a grammar from a schema is
bounded (``check_schema``'s limits) and runs off the event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from starlette.concurrency import run_in_threadpool

from homepd.core.chatformat import (ChatFormat, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec, template_messages,
                                    template_tools)
from homepd.core.replyparser import ReplyParser
from homepd.core.sampling import Grammar, SamplingParams
from homepd.engine.prompt import ChatExtras
from homepd.errors import RequestError
from homepd.llm import grammar as grammars
from homepd.serve.errors import APIError
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

# parts a text-only model cannot take, by OpenAI's (and vLLM's) part types
MEDIA_PARTS = {"image_url": "an image", "input_image": "an image", "image": "an image", "input_audio": "audio",
               "audio_url": "audio", "video_url": "a video", "file": "a file", "input_file": "a file"}


@dataclass(frozen=True)
class RequestPlan:
    """What one request runs, decided before the engine sees it."""
    prompt: str | None
    messages: list[dict] | None
    chat: ChatExtras | None
    params: SamplingParams
    chat_format: ChatFormat | None     # None: a text completion (its text is returned as it is)
    tools_active: bool = False
    envelope: bool = False             # the generic JSON envelope: the reply is {"response"} or {"tool_calls"}
    tool_names: tuple[str, ...] = ()

    def parser(self) -> ReplyParser | None:
        """A fresh parser of this request's reply (None: the text is the answer, as it comes)."""
        fmt = self.chat_format
        if fmt is None or (not self.tools_active and fmt.think is None):
            return None
        return ReplyParser(fmt, tools_active=self.tools_active, envelope=self.envelope,
                           tool_names=self.tool_names if self.tools_active else None)


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
        if isinstance(body, CompletionRequest):
            grammar = await _output_grammar(body, None)
            return RequestPlan(body.prompt_text(), None, None, replace(params, grammar=grammar), None)
        check_parts(body, model_name)
        tools = ToolSpec.parse_all(body.tools or [])
        choice = ToolChoice.parse(body.tool_choice, tools)
        tools_active = bool(tools) and choice.mode is not ToolChoiceMode.NONE
        offered = tools if tools_active else ()  # why: tool_choice none: the model is not told of them
        messages = template_messages(chat_format, [_message(m) for m in body.messages], offered)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        extras = ChatExtras(tools=template_tools(chat_format, offered), template_kwargs=kwargs or None)
        if tools_active:
            grammar = await run_in_threadpool(grammars.tool_grammar, chat_format, tools, choice,
                                              body.parallel_tool_calls is True, _response_schema(body))
        else:
            grammar = await _output_grammar(body, chat_format)
        envelope = tools_active and chat_format.tools is ToolFormat.GENERIC
        return RequestPlan(None, messages, extras, replace(params, grammar=grammar), chat_format, tools_active,
                           envelope, tuple(t.name for t in tools))
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


def _response_schema(body) -> dict | bool | None:
    """The schema the answer must follow (response_format json_schema, json_object's, llama-server's
    json_schema field), or None."""
    rf = body.response_format
    if rf is not None and rf.type == "json_schema":
        return rf.json_schema.schema_
    if rf is not None and rf.type == "json_object":
        return rf.schema_ if rf.schema_ is not None else {"type": "object"}
    return body.json_schema


async def _output_grammar(body, chat_format: ChatFormat | None) -> Grammar | None:
    """The grammar of a request's structured output, or None."""
    if body.grammar is not None:
        return Grammar(body.grammar, "grammar")
    rf = body.response_format
    if rf is not None and rf.type == "json_object" and rf.schema_ is None:
        return grammars.json_object_grammar(chat_format)
    schema = _response_schema(body)
    if schema is None:
        return None
    path = "response_format.json_schema.schema" if rf is not None and rf.type == "json_schema" else \
        "response_format.schema" if rf is not None else "json_schema"
    return await run_in_threadpool(grammars.json_schema_grammar, schema, chat_format, path)


def arguments_json(arguments: str) -> str:
    """A tool call's arguments as OpenAI sends them: a JSON string (compact when it parses)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return arguments
