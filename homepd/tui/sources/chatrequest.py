"""A chat turn as each source sends it and reads its reply: the demo tool the tester can offer (ctrl+o), the
fields it adds to an OpenAI body and the pieces of a streamed OpenAI chunk (``chunk_deltas``), and the plan the
app's own engine runs.

The engine side asks for the same plan ``homepd serve`` asks for (``homepd.engine.chatplan.plan_chat``: the
template's messages and tools, the grammar that keeps a call to the tool's schema, the reply parser), with what
the remote tester's request carries: the demo tool, tool choice auto, one call at a time.  The app does not
import ``homepd.serve`` (faces never import each other).
"""
from __future__ import annotations

from homepd.chat.format import ChatFormat, ToolChoice, ToolChoiceMode, ToolSpec
from homepd.chat.reply import Delta, DeltaKind
from homepd.core.records import RecordShapeError
from homepd.engine.chatplan import ChatPlan, plan_chat

DEMO_TOOL = ToolSpec(
    "get_current_time", "The current date and time in a timezone (an IANA name such as Europe/Paris, or UTC).",
    {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]})
DEMO_CHOICE = ToolChoice(ToolChoiceMode.AUTO)


def openai_tool_fields() -> dict:
    """The fields an OpenAI chat request carries to offer the demo tool."""
    return {"tools": [DEMO_TOOL.to_openai()], "tool_choice": DEMO_CHOICE.mode.value}


def engine_chat(fmt: ChatFormat | None, messages: list[dict], offer_tool: bool) -> ChatPlan:
    """The plan the engine runs for ``messages`` (OpenAI's shape), offering the demo tool or not: what the remote
    tester's request (``openai_tool_fields``) asks ``homepd serve`` for.  May block (a grammar is built): call it
    off the app's loop."""
    return plan_chat(fmt, messages, tools=(DEMO_TOOL,) if offer_tool else (), choice=DEMO_CHOICE)


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
