"""A chat turn as each source sends it and reads its reply: the demo tool the tester can offer (ctrl+o), the
fields it adds to an OpenAI body and the pieces of a streamed OpenAI chunk (``chunk_deltas``), and what the
app's own engine is given and how its text is read back.

The engine side does what ``homepd serve`` does for a chat request, from the same pieces of
``homepd.core.chatformat``: the history in the shape the model's template wants (``template_messages``),
the template's ``tools`` (``template_tools``), the grammar that keeps a call to the tool's schema
(``homepd.llm.grammar``), and a ``ReplyParser`` that splits the text into reasoning, content and tool calls.
The app does not import ``homepd.serve`` (faces never import each other).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from homepd.core.chatformat import (ChatFormat, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec, template_messages,
                                    template_tools)
from homepd.core.reply import Delta, DeltaKind
from homepd.core.replyparser import ReplyParser
from homepd.core.records import RecordShapeError
from homepd.core.sampling import Grammar
from homepd.engine.prompt import ChatExtras

DEMO_TOOL = ToolSpec(
    "get_current_time", "The current date and time in a timezone (an IANA name such as Europe/Paris, or UTC).",
    {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]})
DEMO_CHOICE = ToolChoice(ToolChoiceMode.AUTO)


def openai_tool_fields() -> dict:
    """The fields an OpenAI chat request carries to offer the demo tool."""
    return {"tools": [DEMO_TOOL.to_openai()], "tool_choice": DEMO_CHOICE.mode.value}


@dataclass(frozen=True)
class EngineChat:
    """One chat turn as the app's own engine runs it (``fmt`` None: an engine that does not say its chat format;
    the messages go as they are and the reply is plain text)."""
    messages: list[dict]
    extras: ChatExtras | None
    grammar: Grammar | None
    fmt: ChatFormat | None
    tools_active: bool = False

    def parser(self) -> ReplyParser | None:
        """A fresh parser of the reply (None: the text is the answer, as it comes)."""
        if self.fmt is None:
            return None
        envelope = self.tools_active and self.fmt.tools is ToolFormat.GENERIC
        return ReplyParser(self.fmt, tools_active=self.tools_active, envelope=envelope,
                           tool_names=(DEMO_TOOL.name,) if self.tools_active else None)


def engine_chat(fmt: ChatFormat | None, messages: list[dict], offer_tool: bool) -> EngineChat:
    """What the engine is given for ``messages`` (OpenAI's shape), offering the demo tool or not.  May block
    (the grammar is built, and parsed by llama.cpp, once per chat format): call it off the app's loop."""
    if fmt is None:
        return EngineChat(messages, None, None, None)
    offered = (DEMO_TOOL,) if offer_tool else ()
    extras = ChatExtras(tools=template_tools(fmt, offered), template_kwargs=None)
    return EngineChat(template_messages(fmt, messages, offered), extras,
                      demo_grammar(fmt) if offer_tool else None, fmt, offer_tool)


@lru_cache(maxsize=4)
def demo_grammar(fmt: ChatFormat) -> Grammar | None:
    """The grammar of a call to the demo tool in ``fmt``'s syntax (lazy for auto: free text until a call)."""
    # why: llama_cpp loads for the embedded engine's chats only; the remote app never loads it
    from homepd.llm.grammar import tool_grammar

    return tool_grammar(fmt, (DEMO_TOOL,), DEMO_CHOICE, True)


def chunk_deltas(delta: dict, started: set[int]) -> list[Delta]:
    """The pieces of one streamed chunk's ``delta``: ``reasoning_content``, ``content``, then each
    ``tool_calls`` fragment (``{index, id?, function: {name?, arguments}}``) as a call's start the first time
    its index is seen (``started`` keeps them) and its arguments' text."""
    out = []
    for kind, key in ((DeltaKind.REASONING, "reasoning_content"), (DeltaKind.CONTENT, "content")):
        text = delta.get(key)
        if isinstance(text, str) and text:
            out.append(Delta(kind, text))
    for fragment in delta.get("tool_calls") or ():
        try:
            index, function = int(fragment["index"]), fragment.get("function") or {}
        except (KeyError, TypeError, ValueError):
            raise RecordShapeError(f"a streamed tool call fragment has no index: {fragment!r}") from None
        if index not in started:
            started.add(index)
            out.append(Delta(DeltaKind.TOOL_CALL_START, index=index, id=fragment.get("id") or f"call_{index}",
                             name=function.get("name") or "?"))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out.append(Delta(DeltaKind.TOOL_CALL_ARGS, arguments, index=index))
    return out
