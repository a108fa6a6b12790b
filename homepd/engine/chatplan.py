"""One chat plan, built once below the faces: what a request runs and how its reply is read back.

``plan_chat`` is homepd's ``common_chat_templates_apply``: from a chat format, the history (OpenAI's message
shape), the tools offered, the tool choice and the structured output asked for, it makes the one ``ChatPlan``:
the template's messages (tool calls and results in the shape the model's template or the generic format wants,
``homepd.chat.format``), the template's extras, the grammar the answer samples under (``homepd.llm.grammar``),
and the reply parser's settings, derived from that same plan (``ChatPlan.parser``).  ``plan_completion`` is the
same for a text completion.  A face (the OpenAI routes, the Ollama routes, the app's chat tester) only maps its
wire format onto these arguments and its own errors onto the ``RequestError`` they raise.

Building a grammar may take milliseconds to seconds for a large schema (bounded by ``homepd.structured.limits``):
call these off an event loop.  Tool grammars are cached by their JSON (a client such as Home Assistant sends the
same tools with every request).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from homepd.chat.format import (ChatFormat, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec, template_messages,
                                template_tools)
from homepd.chat.parser import ReplyParser
from homepd.core.sampling import Grammar
from homepd.engine.prompt import ChatExtras

RESPONSE_SCHEMA_PATH = "response_format.json_schema.schema"
AUTO = ToolChoice(ToolChoiceMode.AUTO)


@dataclass(frozen=True)
class Output:
    """The structured output a request asks for (at most one of them): a GBNF grammar of its own (llama-server's
    ``grammar``), a JSON ``schema`` the answer follows (``schema_path`` names it in errors), or any JSON object."""
    gbnf: str | None = None
    schema: object | None = None
    schema_path: str = RESPONSE_SCHEMA_PATH
    json_object: bool = False

    @property
    def is_empty(self) -> bool:
        return self.gbnf is None and self.schema is None and not self.json_object


NO_OUTPUT = Output()


@dataclass(frozen=True)
class ChatPlan:
    """What one request runs, decided before the engine sees it: a text completion's ``prompt``, or a chat's
    template ``messages`` and ``chat`` extras; the ``grammar`` it samples under; and what its reply parser
    reads (``fmt`` None: the text is the answer, as it comes)."""
    prompt: str | None
    messages: list[dict] | None
    chat: ChatExtras | None
    grammar: Grammar | None
    fmt: ChatFormat | None
    tools_active: bool = False
    envelope: bool = False             # the generic JSON envelope: the reply is {"response"} or {"tool_calls"}
    tool_names: tuple[str, ...] = ()

    def parser(self) -> ReplyParser | None:
        """A fresh parser of this request's reply (None: the text is the answer, as it comes)."""
        fmt = self.fmt
        if fmt is None or (not self.tools_active and fmt.think is None):
            return None
        return ReplyParser(fmt, tools_active=self.tools_active, envelope=self.envelope,
                           tool_names=self.tool_names if self.tools_active else None)


def plan_chat(fmt: ChatFormat | None, messages: list[dict], *, tools: tuple[ToolSpec, ...] = (),
              choice: ToolChoice = AUTO, parallel: bool = False, output: Output = NO_OUTPUT,
              template_kwargs: dict | None = None) -> ChatPlan:
    """The plan of a chat turn: ``messages`` in OpenAI's shape (role, content, tool_calls, tool_call_id, name),
    ``tools`` offered under ``choice`` (``parallel``: several calls in one reply), ``output`` the answer's
    structured output.  ``fmt`` None: an engine that does not say its chat format; the messages go as they are
    and the reply is plain text.  Raises RequestError (with its JSON path) for what cannot run."""
    if fmt is None:
        return ChatPlan(None, messages, None, _output_grammar(output, None), None)
    tools_active = bool(tools) and choice.mode is not ToolChoiceMode.NONE
    offered = tools if tools_active else ()  # why: tool_choice none: the model is not told of them
    history = template_messages(fmt, messages, offered)
    extras = ChatExtras(tools=template_tools(fmt, offered), template_kwargs=template_kwargs or None)
    if tools_active:
        # why a string key: a client sends the same tools with every request, and building them is not free
        schema = None if output.schema is None and not output.json_object else \
            output.schema if output.schema is not None else {"type": "object"}
        grammar = _tool_grammar(fmt, json.dumps([t.to_openai() for t in tools], sort_keys=True), choice, parallel,
                                json.dumps(schema, sort_keys=True) if schema is not None else None)
    else:
        grammar = _output_grammar(output, fmt)
    return ChatPlan(None, history, extras, grammar, fmt, tools_active,
                    envelope=tools_active and fmt.tools is ToolFormat.GENERIC, tool_names=tuple(t.name for t in tools))


def plan_completion(prompt: str, output: Output = NO_OUTPUT) -> ChatPlan:
    """The plan of a text completion: the prompt as it is, its structured output, the text back as it comes."""
    return ChatPlan(prompt, None, None, _output_grammar(output, None), None)


def _output_grammar(output: Output, fmt: ChatFormat | None) -> Grammar | None:
    """The grammar of a request's structured output (after a reasoning block where ``fmt`` thinks), or None."""
    if output.is_empty:
        return None
    if output.gbnf is not None:
        return Grammar(output.gbnf, "grammar")
    # why: llama_cpp loads for a plan with a grammar only (the app attached to a service never builds one)
    from homepd.llm import grammar as grammars

    if output.schema is None:
        return grammars.json_object_grammar(fmt)
    return grammars.json_schema_grammar(output.schema, fmt, output.schema_path)


@lru_cache(maxsize=32)
def _tool_grammar(fmt: ChatFormat, tools_json: str, choice: ToolChoice, parallel: bool,
                  response_json: str | None) -> Grammar | None:
    # why: llama_cpp loads for a plan with tools only, as in _output_grammar
    from homepd.llm.grammar import tool_grammar

    tools = ToolSpec.parse_all(json.loads(tools_json))
    return tool_grammar(fmt, tools, choice, parallel, None if response_json is None else json.loads(response_json))
