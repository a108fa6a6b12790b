"""Reads a reply as it is generated: reasoning split off at its markers, then the body in the request's format
(plain content, calls in the template's marker syntax, or the generic JSON envelope: ``homepd.core.
replybodies``), as deltas while it streams and as a ``Reply`` at the end."""
from __future__ import annotations

from typing import Iterable

from homepd.chat.format import ChatFormat, ThinkMarkers, ToolFormat
from homepd.chat.reply import Delta, Reply, ReplyBody, ReplyCollector, partial_suffix
from homepd.chat.bodies import EnvelopeBody, MarkerBody


class ReplyParser:
    """Reads a reply as it is generated: ``feed`` returns the deltas each piece of text makes, ``flush`` the
    ones held back until the end (a possible marker's start, whitespace before a call), ``finish`` the Reply.

    ``tools_active``: calls in ``fmt.tools``'s syntax are read as calls; ``envelope``: the reply is the GENERIC
    JSON envelope (a grammar forces it).  ``tool_names``: the names that make a call (None: any)."""

    def __init__(self, fmt: ChatFormat, tools_active: bool, envelope: bool = False, *,
                 tool_names: Iterable[str] | None = None):
        self._out = ReplyCollector()
        names = None if tool_names is None else frozenset(tool_names)
        self._think = _ThinkSplitter(fmt.think, fmt.opens_thinking) if fmt.think else None
        if tools_active and envelope:
            self._body: ReplyBody = EnvelopeBody(self._out, names)
        elif tools_active and fmt.tools is not ToolFormat.GENERIC:
            self._body = MarkerBody(fmt.tools, self._out, names)
        else:
            self._body = PlainBody(self._out)
        self._is_plain = self._think is None and isinstance(self._body, PlainBody)
        self._flushed = False

    def feed(self, text: str) -> list[Delta]:
        assert not self._flushed, "feed after flush"
        if self._is_plain:  # why: the common case, no markers to look for: one delta, no buffering
            self._out.content(text)
        elif self._think is None:
            self._body.feed(text, final=False)
        else:
            self._split(self._think.feed(text, final=False), final=False)
        return self._out.take()

    def flush(self) -> list[Delta]:
        """The end of the text: the deltas held back so far."""
        if not self._flushed:
            self._flushed = True
            if self._think is not None:
                self._split(self._think.feed("", final=True), final=True)
            else:
                self._body.feed("", final=True)
        return self._out.take()

    def finish(self) -> Reply:
        self.flush()
        return self._out.reply()

    def _split(self, parts: list[tuple[bool, str]], final: bool) -> None:
        for is_reasoning, text in parts:
            if is_reasoning:
                self._out.reasoning(text)
            else:
                self._body.feed(text, final=False)
        if final:
            self._body.feed("", final=True)


class _ThinkSplitter:
    """Splits text into reasoning (between the think markers, stripped) and the rest, holding back what could
    still become a marker.  A reasoning block is only recognised at the start of the reply."""

    def __init__(self, markers: ThinkMarkers, opens: bool):
        self.markers = markers
        self.state = "lead" if opens else "start"   # start -> lead -> reasoning -> gap -> body
        self.buf = ""

    def feed(self, text: str, final: bool) -> list[tuple[bool, str]]:
        self.buf += text
        out: list[tuple[bool, str]] = []
        start, end = self.markers.start, self.markers.end
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(start):
                    self.buf, self.state = head[len(start):], "lead"
                elif not final and start.startswith(head):
                    return out
                else:
                    self.state = "body"
            elif self.state in ("lead", "gap"):   # the whitespace after a marker is dropped
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    return out
                self.state = "reasoning" if self.state == "lead" else "body"
            elif self.state == "reasoning":
                i = self.buf.find(end)
                if i >= 0:
                    out.append((True, self.buf[:i].rstrip()))
                    self.buf, self.state = self.buf[i + len(end):], "gap"
                    continue
                keep = self.buf if final else self.buf[:len(self.buf) - partial_suffix(self.buf, end)]
                ready = keep.rstrip()
                out.append((True, ready))
                self.buf = "" if final else self.buf[len(ready):]
                return out
            else:
                if self.buf:
                    out.append((False, self.buf))
                self.buf = ""
                return out


class PlainBody(ReplyBody):
    def __init__(self, out: ReplyCollector):
        self.out = out

    def feed(self, text: str, final: bool) -> None:
        self.out.content(text)
