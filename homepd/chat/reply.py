"""A parsed reply and the pieces it streams as: content, reasoning and tool calls (``Delta``), collected into a
``Reply``; the base of the parsers' bodies (``homepd.chat.parser``, ``homepd.chat.bodies``)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import Enum


class DeltaKind(str, Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL_START = "tool_call_start"   # index, id, name
    TOOL_CALL_ARGS = "tool_call_args"     # index, text: a fragment of the arguments' JSON


@dataclass(frozen=True)
class Delta:
    kind: DeltaKind
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str   # the arguments object's JSON text (its streamed fragments joined)


@dataclass(frozen=True)
class Reply:
    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...] = ()


class ReplyCollector:
    """The reply so far, and the deltas not yet handed out."""

    def __init__(self):
        self.deltas: list[Delta] = []
        self.contents: list[str] = []
        self.reasonings: list[str] = []
        self.calls: list[list] = []   # [id, name, argument fragments, dropped]

    def content(self, text: str) -> None:
        if text:
            self.contents.append(text)
            self.deltas.append(Delta(DeltaKind.CONTENT, text))

    def reasoning(self, text: str) -> None:
        if text:
            self.reasonings.append(text)
            self.deltas.append(Delta(DeltaKind.REASONING, text))

    def start_call(self, name: str) -> int:
        index, call_id = len(self.calls), "call_" + secrets.token_hex(12)
        self.calls.append([call_id, name, [], False])
        self.deltas.append(Delta(DeltaKind.TOOL_CALL_START, index=index, id=call_id, name=name))
        return index

    def call_args(self, index: int, text: str) -> None:
        if text:
            self.calls[index][2].append(text)
            self.deltas.append(Delta(DeltaKind.TOOL_CALL_ARGS, text, index=index))

    def drop_call(self, index: int) -> None:
        self.calls[index][3] = True

    def take(self) -> list[Delta]:
        out, self.deltas = self.deltas, []
        return out

    def reply(self) -> Reply:
        calls = tuple(ToolCall(i, n, "".join(a)) for i, n, a, dropped in self.calls if not dropped)
        return Reply("".join(self.contents) or None, "".join(self.reasonings) or None, calls)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (what to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReplyBody:
    """What reads the reply's text after the reasoning: plain content, calls in a marker format, the envelope."""

    def feed(self, text: str, final: bool) -> None:
        raise NotImplementedError
