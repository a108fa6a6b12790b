"""The reply bodies that hold tool calls: calls in a template's marker syntax (Hermes, Llama 3, Mistral) and
llama-server's generic JSON envelope, each following its JSON as it arrives so a call's name and arguments
stream (``homepd.chat.parser`` drives them)."""
from __future__ import annotations

import json
import re

from homepd.chat.format import ToolFormat
from homepd.chat.jsonstream import CallReader, ValueScanner, unescape
from homepd.chat.reply import ReplyBody, ReplyCollector, partial_suffix


class MarkerBody(ReplyBody):
    """Content with calls in HERMES, LLAMA3 or MISTRAL syntax.  A bare call (LLAMA3's ``{``, MISTRAL's ``[{``)
    is recognised where the body starts or right after a call: a control-token opener may not reach the text."""

    def __init__(self, fmt: ToolFormat, out: ReplyCollector, names: frozenset[str] | None):
        self.fmt, self.out, self.names = fmt, out, names
        self.buf = ""
        self.state = "text"
        self.can_be_bare = fmt in (ToolFormat.LLAMA3, ToolFormat.MISTRAL)
        self.after_call = False
        self.reader: CallReader | None = None
        self.raw = ""          # the unfinished call's text (from its opener), content if it fails
        self.ws_before = ""    # the whitespace dropped before it, restored if it fails
        self.n_group_calls = 0

    def feed(self, text: str, final: bool) -> None:
        self.buf += text
        while getattr(self, "_" + self.state.replace("-", "_"))(final):
            pass

    def _take(self, n: int) -> None:
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]

    def _begin(self, ws: str, state: str) -> bool:
        self.ws_before, self.raw, self.state, self.n_group_calls = ws, "", state, 0
        return True

    def _text(self, final: bool) -> bool:
        buf, opener = self.buf, self.fmt.opener
        if not buf:
            return False
        head = buf.lstrip()
        if self.can_be_bare and head:
            ws = buf[:len(buf) - len(head)]
            if self.fmt is ToolFormat.LLAMA3 and head[0] == "{":
                self.buf = head
                return self._begin(ws, "object")
            if self.fmt is ToolFormat.MISTRAL and head[0] == "[":
                rest = head[1:].lstrip()
                if rest.startswith("{"):
                    self.buf = head
                    return self._begin(ws, "array")
                if not rest and not final:
                    return False
        i = buf.find(opener)
        if i >= 0:
            self._content(buf[:i].rstrip())
            self.buf = buf[i + len(opener):]
            self._begin(buf[len(buf[:i].rstrip()):i], "array" if self.fmt is ToolFormat.MISTRAL else "object")
            self.raw = opener
            return True
        if final:
            if not (self.after_call and not buf.strip()):
                self._content(buf)
            self.buf = ""
            return False
        ready = buf[:len(buf) - partial_suffix(buf, opener)].rstrip()
        if ready:
            self._content(ready)
            self.buf = buf[len(ready):]
        return False

    def _content(self, text: str) -> None:
        if text:
            self.out.content(text)
            self.after_call = self.can_be_bare = False

    def _array(self, final: bool) -> bool:     # MISTRAL: '[' before the calls
        head = self.buf.lstrip()
        if not head:
            return self._fail() if final else False
        if head[0] != "[":
            return self._fail()
        self._take(len(self.buf) - len(head) + 1)
        self.state = "element"
        return True

    def _element(self, final: bool) -> bool:   # MISTRAL: a call or the end of the list
        head = self.buf.lstrip()
        if not head:
            return self._fail() if final else False
        if head[0] == "]" and self.n_group_calls:
            self.buf = head[1:]
            return self._called()
        if head[0] != "{":
            return self._fail()
        self.buf = head
        self.state = "object"
        return True

    def _object(self, final: bool) -> bool:
        if self.reader is None:
            head = self.buf.lstrip()
            if not head:
                return self._fail() if final else False
            if head[0] != "{":
                return self._fail()
            self._take(len(self.buf) - len(head))
            self.reader = CallReader(self.out, self.names)
        self._take(self.reader.feed(self.buf))
        if self.reader.scan.failed:
            return self._fail()
        if not self.reader.scan.done:
            return self._fail() if final else False
        if self.fmt is ToolFormat.HERMES:
            self.state = "close"
            return True
        return self._end_call()

    def _close(self, final: bool) -> bool:    # HERMES: whitespace, then </tool_call>
        head, closer = self.buf.lstrip(), self.fmt.closer
        if head.startswith(closer):
            self._take(len(self.buf) - len(head) + len(closer))
        elif closer.startswith(head) and not final:
            return False
        return self._end_call()                # lenient: a complete call without its closer is still a call

    def _end_call(self) -> bool:
        reader, self.reader = self.reader, None
        if not reader.finish():
            return self._fail(reader_done=True)
        self.n_group_calls += 1
        self.raw = self.ws_before = ""
        if self.fmt is ToolFormat.MISTRAL:
            self.state = "after-element"
            return True
        return self._called()

    def _after_element(self, final: bool) -> bool:   # MISTRAL: ',' or ']'
        head = self.buf.lstrip()
        if not head:
            return self._called() if final else False
        if head[0] == ",":
            self.buf = head[1:]
            self.state = "element"
            return True
        if head[0] == "]":
            self.buf = head[1:]
        return self._called()

    def _called(self) -> bool:
        self.state, self.after_call, self.raw = "text", True, ""
        self.can_be_bare = self.fmt is ToolFormat.LLAMA3
        return True

    def _fail(self, reader_done: bool = False) -> bool:
        if self.reader is not None and not reader_done:
            self.reader.abandon()
        self.reader = None
        self.out.content(self.ws_before + self.raw)
        self.raw = self.ws_before = ""
        self.state, self.after_call, self.can_be_bare = "text", False, False
        return True


_ENVELOPE_KEY = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*(?=\S)')
_MAX_KEY = 256        # an envelope key longer than this is not one of ours


class EnvelopeBody(ReplyBody):
    """The GENERIC envelope: ``{"response": "..."}`` streams its decoded string as content; ``{"tool_calls":
    [...]}`` (or llama-server's ``{"tool_call": {...}}``) gives calls.  A reply that is no envelope at all is
    content; one cut off keeps what was decoded (and a cut-off call's text, as content)."""

    def __init__(self, out: ReplyCollector, names: frozenset[str] | None):
        self.out, self.names = out, names
        self.seen = ""          # all text so far, for a reply that turns out to be no envelope
        self.buf = ""
        self.state = "open"     # open, key, response, after, element, call, done, plain
        self.reader: CallReader | None = None
        self.call_raw = ""
        self.is_single = False  # {"tool_call": {...}} rather than {"tool_calls": [...]}
        self.is_started = False  # some content or a call came out of the envelope

    def feed(self, text: str, final: bool) -> None:
        self.seen += text
        self.buf += text
        while getattr(self, "_" + self.state)(final):
            pass
        if final and self.state == "call":
            self.reader.abandon()
            self.out.content(self.call_raw)

    def _unexpected(self) -> bool:
        """Text the envelope cannot hold: all of it is content if nothing came out yet, else the rest is."""
        self.out.content(self.buf if self.is_started else self.seen)
        self.buf, self.state = "", "plain" if not self.is_started else "done"
        return False

    def _plain(self, final: bool) -> bool:
        self.out.content(self.buf)
        self.buf = ""
        return False

    def _open(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        if head[0] != "{":
            return self._unexpected()
        self.buf, self.state = head[1:], "key"
        return True

    def _key(self, final: bool) -> bool:
        head = self.buf.lstrip(" \t\n\r,")
        if not head:
            return False
        if head[0] == "}":
            self.buf, self.state = head[1:], "done"
            return True
        match = _ENVELOPE_KEY.match(head)
        if match is None:
            if head[0] == '"' and len(head) <= _MAX_KEY and not final:
                return False   # the key is still arriving
            return False if final else self._unexpected()
        key, rest = json.loads(f'"{match[1]}"'), head[match.end():]
        if key == "response" and rest[0] == '"':
            self.buf, self.state = rest[1:], "response"
        elif key == "response" and rest[0] in "{[":   # a structured answer (response_format with tools)
            self.buf, self.state, self.value = rest, "response_value", ValueScanner()
        elif key in ("tool_calls", "tool_call") and rest[0] == ("[" if key == "tool_calls" else "{"):
            self.is_single = key == "tool_call"
            self.buf, self.state = rest[1:] if key == "tool_calls" else rest, "element"
        else:
            return self._unexpected()
        return True

    def _response_value(self, final: bool) -> bool:
        """A JSON object or array answer: its raw text is the content, as it arrives."""
        taken = self.value.feed(self.buf)
        if taken:
            self.is_started = True
            self.out.content(self.buf[:taken])
        self.buf = self.buf[taken:]
        if self.value.done:
            self.state = "after"
            return True
        return False

    def _response(self, final: bool) -> bool:
        buf, parts, i = self.buf, [], 0
        while i < len(buf) and buf[i] != '"':
            if buf[i] == "\\":
                char, n = unescape(buf, i)
                if n == 0:   # the escape is still arriving
                    break
                parts.append(char)
                i += n
            else:
                j = i
                while j < len(buf) and buf[j] not in '"\\':
                    j += 1
                parts.append(buf[i:j])
                i = j
        text = "".join(parts)
        if text:
            self.is_started = True
            self.out.content(text)
        if i < len(buf) and buf[i] == '"':
            self.buf, self.state = buf[i + 1:], "after"
            return True
        self.buf = buf[i:]
        return False

    def _after(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            self.buf = ""
            return False
        if head[0] not in ",}":
            return self._unexpected()
        self.buf, self.state = head[1:], "key" if head[0] == "," else "done"
        return True

    def _element(self, final: bool) -> bool:
        head = self.buf.lstrip(" \t\n\r,")
        if not head:
            return False
        if head[0] == "]" and not self.is_single:
            self.buf, self.state = head[1:], "after"
            return True
        if head[0] != "{":
            return self._unexpected()
        self.buf, self.call_raw, self.state = head, "", "call"
        self.reader = CallReader(self.out, self.names)
        return True

    def _call(self, final: bool) -> bool:
        taken = self.reader.feed(self.buf)
        self.call_raw += self.buf[:taken]
        self.buf = self.buf[taken:]
        if self.reader.scan.failed:
            self.reader.abandon()
            self.buf = self.call_raw + self.buf
            return self._unexpected()
        if not self.reader.scan.done:
            return False
        if not self.reader.finish():
            self.out.content(self.call_raw)
        self.reader, self.call_raw, self.is_started = None, "", True
        self.state = "after" if self.is_single else "element"
        return True

    def _done(self, final: bool) -> bool:
        if self.buf.strip():
            self.out.content(self.buf)
        self.buf = ""
        return False
