"""Reading a reply's JSON as it streams: where an object ends (``ObjectScanner``), a tool call's name and argument
text as they arrive (``CallReader``), a JSON value of unknown type (``ValueScanner``) and a string's escapes
(``unescape``).  The bodies that hold tool calls (``homepd.chat.bodies``) are built on them."""
from __future__ import annotations

import json
import re

from homepd.chat.reply import ReplyCollector

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LOW_SURROGATE_START = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")


class ObjectScanner:
    """Follows one JSON object as it arrives: where each top-level member's value lies, so that a call's name is
    known as soon as its string closes and its arguments can stream.  The full text is checked by json.loads
    once it is complete; this only tracks strings and nesting."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.expect = "open"        # open, key, colon, value, primitive, comma
        self.key: str | None = None
        self.key_start = self.value_start = 0
        self.members: dict[str, tuple[int, int]] = {}
        self.in_value = self.done = self.failed = False

    def feed(self, chunk: str) -> int:
        """Take text up to the object's end; return how much was taken."""
        base = len(self.text)
        self.text += chunk
        for pos in range(base, len(self.text)):
            self._step(self.text[pos], pos)
            if self.done or self.failed:
                self.text = self.text[:pos + 1]
                return pos + 1 - base
        return len(chunk)

    def value_span(self, key: str) -> tuple[int, int | None] | None:
        """(start, end) of member ``key``'s value; end None while it is still arriving."""
        if key in self.members:
            return self.members[key]
        if self.in_value and self.key == key:
            return self.value_start, None
        return None

    def string_member(self, key: str) -> str | None:
        span = self.members.get(key)
        if span is None or self.text[span[0]] != '"':
            return None
        return json.loads(self.text[span[0]:span[1]])

    def _step(self, c: str, pos: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed(pos)
            return
        if self.expect == "primitive":
            if c not in " \t\n\r,}":
                return
            self._member(pos)
        if c in " \t\n\r":
            return
        if self.depth >= 2:
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._member(pos + 1)
            return
        expect = self.expect
        if expect == "open" and c == "{":
            self.depth, self.expect = 1, "key-or-end"
        elif expect in ("key", "key-or-end") and c == '"':
            self.in_string, self.key_start = True, pos
        elif expect in ("comma", "key-or-end") and c == "}":
            self.depth, self.done = 0, True
        elif expect == "colon" and c == ":":
            self.expect = "value"
        elif expect == "comma" and c == ",":
            self.expect = "key"
        elif expect == "value":
            self.value_start, self.in_value = pos, True
            if c == '"':
                self.in_string, self.expect = True, "comma-string"
            elif c in "{[":
                self.depth = 2
            elif c in "-0123456789tfn":
                self.expect = "primitive"
            else:
                self.failed = True
        else:
            self.failed = True

    def _string_closed(self, pos: int) -> None:
        if self.expect == "comma-string":
            self._member(pos + 1)
        else:
            self.key, self.expect = json.loads(self.text[self.key_start:pos + 1]), "colon"

    def _member(self, end: int) -> None:
        self.members.setdefault(self.key, (self.value_start, end))
        self.key, self.expect, self.in_value = None, "comma", False


class CallReader:
    """One call's JSON object as it arrives: its START once the name is known (and allowed), then its arguments
    as they stream (an arguments object streams as its raw text; one given as a JSON string, or missing, comes
    whole at the end, as compact JSON)."""

    def __init__(self, out: ReplyCollector, names: frozenset[str] | None):
        self.scan = ObjectScanner()
        self.out, self.names = out, names
        self.index: int | None = None
        self.sent = 0

    def feed(self, text: str) -> int:
        taken = self.scan.feed(text)
        self._stream()
        return taken

    def _arguments_span(self) -> tuple[int, int | None] | None:
        return self.scan.value_span("arguments") or self.scan.value_span("parameters")

    def _stream(self) -> None:
        scan = self.scan
        if self.index is None:
            name = scan.string_member("name")
            if name is None or (self.names is not None and name not in self.names):
                return
            self.index = self.out.start_call(name)
        span = self._arguments_span()
        if span is not None and scan.text[span[0]] == "{":
            raw = scan.text[span[0]:span[1] if span[1] is not None else len(scan.text)]
            self.out.call_args(self.index, raw[self.sent:])
            self.sent = len(raw)

    def finish(self) -> bool:
        """The object is complete: True if it is a call (all of it now handed out), False if it is not (then the
        caller turns its text into content)."""
        try:
            json.loads(self.scan.text)
            span = self._arguments_span()
            arguments = {} if span is None else json.loads(self.scan.text[span[0]:span[1]])
        except ValueError:
            return self._reject()
        if isinstance(arguments, str):   # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                return self._reject()
        if not isinstance(arguments, dict) or self.index is None:
            return self._reject()
        if not self.sent:
            self.out.call_args(self.index, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))
        return True

    def _reject(self) -> bool:
        self.abandon()
        return False

    def abandon(self) -> None:
        if self.index is not None:
            self.out.drop_call(self.index)


class ValueScanner:
    """Follows one JSON object or array as it arrives, to its closing bracket (strings and nesting only)."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = self.done = False

    def feed(self, text: str) -> int:
        """Take text up to the value's end; return how much was taken."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def unescape(buf: str, i: int) -> tuple[str, int]:
    """The character the JSON escape at ``buf[i]`` stands for and the escape's length; ("", 0) while it is
    still arriving (a surrogate pair counts as one escape)."""
    if i + 1 >= len(buf):
        return "", 0
    if buf[i + 1] != "u":
        return _ESCAPES.get(buf[i + 1], buf[i + 1]), 2
    digits = buf[i + 2:i + 6]
    if len(digits) < 4:
        return "", 0
    if not re.fullmatch(r"[0-9a-fA-F]{4}", digits):
        return "\ufffd", 6
    code = int(digits, 16)
    if 0xD800 <= code < 0xDC00:   # a high surrogate: its low half follows as \uDC00..\uDFFF
        low = buf[i + 6:i + 12]
        if len(low) == 6 and re.fullmatch(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}", low):
            return chr(0x10000 + ((code - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00)), 12
        if len(low) < 6 and _LOW_SURROGATE_START.fullmatch(low):
            return "", 0
        return "\ufffd", 6
    return ("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code)), 6
