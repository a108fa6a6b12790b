"""Chat formats: the tool-call and reasoning syntax a model's chat template speaks, the typed tool request,
the history a template is given, and the parser that turns a reply back into content, reasoning and calls.

``detect`` reads a template's text once (``ChatFormat``).  The request side is typed here (``ToolSpec``,
``ToolChoice``); ``template_messages`` turns OpenAI messages into what the template renders, and
``ReplyParser`` reads the generated text as it streams (``Delta``) and at the end (``Reply``).
The grammars that make a model keep to these formats are ``homepd.llm.grammar``'s.  Pure: standard library only.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Iterable

from homepd.errors import RequestError


class ToolFormat(str, Enum):
    """How a model writes a tool call."""
    HERMES = "hermes"     # Hermes, Qwen2.5, Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    LLAMA3 = "llama3"     # Llama 3.1/3.2: {"name": ..., "parameters": {...}}, maybe after <|python_tag|>
    MISTRAL = "mistral"   # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    GENERIC = "generic"   # no format of its own: the whole reply is llama-server's JSON envelope

    @property
    def opener(self) -> str:
        """The text a call starts with ('' for GENERIC)."""
        return _OPENERS[self]

    @property
    def closer(self) -> str:
        """The text a call ends with ('' where the JSON's own end ends it)."""
        return "</tool_call>" if self is ToolFormat.HERMES else ""

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA3 else "arguments"


_OPENERS = {ToolFormat.HERMES: "<tool_call>", ToolFormat.LLAMA3: "<|python_tag|>",
            ToolFormat.MISTRAL: "[TOOL_CALLS]", ToolFormat.GENERIC: ""}


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str


@dataclass(frozen=True)
class ChatFormat:
    """What a chat template speaks.  ``opens_thinking``: its generation prompt itself writes ``think.start``,
    so the reply starts inside the reasoning (DeepSeek-R1, Qwen3 thinking-only models)."""
    tools: ToolFormat
    template_takes_tools: bool
    think: ThinkMarkers | None
    opens_thinking: bool

    @property
    def control_texts(self) -> tuple[str, ...]:
        """The marker texts the reply parser and the grammars look for.  A detokenizer that drops control
        tokens (``[TOOL_CALLS]`` and ``<|python_tag|>`` are ones) must keep these."""
        texts = [self.think.start, self.think.end] if self.think else []
        texts += [t for t in (self.tools.opener, self.tools.closer) if t]
        return tuple(texts)


PLAIN = ChatFormat(ToolFormat.GENERIC, False, None, False)
_THINK_PAIRS = (ThinkMarkers("<think>", "</think>"), ThinkMarkers("[THINK]", "[/THINK]"))
_JINJA_CODE = re.compile(r"\{[{%](.*?)[}%]\}", re.S)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_TOOLS_VARIABLE = re.compile(r"(?<![\w.])tools\b")
_IF_TAG = re.compile(r"\{%-?\s*(if|elif|else|endif)\b(.*?)-?%\}", re.S)
_ASKS_GENERATION_PROMPT = re.compile(r"(?<!not )\badd_generation_prompt\b")


def detect(template: str | None) -> ChatFormat:
    """The format of a chat template, read from its text (a model with no template: plain ChatML, GENERIC)."""
    if not template:
        return PLAIN
    takes_tools = _reads_tools(template)
    if "<tool_call>" in template:
        tools = ToolFormat.HERMES
    elif "[TOOL_CALLS]" in template:
        tools = ToolFormat.MISTRAL
    elif "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        tools = ToolFormat.LLAMA3
    else:
        tools = ToolFormat.GENERIC
    if not takes_tools:
        tools = ToolFormat.GENERIC  # why: a format's calls are described to the model by the template's tools block
    think = next((m for m in _THINK_PAIRS if m.start in template and m.end in template), None)
    branch = _generation_prompt_branch(template) if think else None
    opens = branch is not None and branch.rfind(think.start) > branch.rfind(think.end)
    return ChatFormat(tools, takes_tools, think, opens)


def _reads_tools(template: str) -> bool:
    """Whether the template's code (not its string literals) reads a ``tools`` variable."""
    return any(_TOOLS_VARIABLE.search(_STRING_LITERAL.sub("''", m[1])) for m in _JINJA_CODE.finditer(template))


def _generation_prompt_branch(template: str) -> str | None:
    """The source of the ``{% if add_generation_prompt %}`` branch (up to its elif/else/endif), if any."""
    tags = list(_IF_TAG.finditer(template))
    for i, tag in enumerate(tags):
        if tag[1] != "if" or not _ASKS_GENERATION_PROMPT.search(tag[2]):
            continue
        depth = 0
        for later in tags[i + 1:]:
            if later[1] == "if":
                depth += 1
            elif depth == 0:
                return template[tag.end():later.start()]
            elif later[1] == "endif":
                depth -= 1
        return template[tag.end():]
    return None


# ---- the request's tools ---------------------------------------------------------------------------------

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # OpenAI's rule for a function name
MAX_TOOLS = 128                                   # OpenAI's limit; each tool adds its schema to the grammar


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call.  ``parameters`` is its JSON Schema (an object)."""
    name: str
    description: str
    parameters: dict

    @staticmethod
    def parse_all(tools: object) -> tuple[ToolSpec, ...]:
        """OpenAI's ``tools`` list as ToolSpecs, or RequestError naming the path of what is wrong."""
        if tools is None:
            return ()
        if not isinstance(tools, list):
            raise RequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
        if len(tools) > MAX_TOOLS:
            raise RequestError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
        specs: list[ToolSpec] = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise RequestError(f"{where}.type must be \"function\" (the only tool type there is)")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise RequestError(f"{where}.function must be an object with a name")
            name = function.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
            if any(s.name == name for s in specs):
                raise RequestError(f"{where}.function.name {name!r} is given to an earlier tool too")
            description = function.get("description", "")
            if not isinstance(description, str):
                raise RequestError(f"{where}.function.description must be a string")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise RequestError(f"{where}.function.parameters must be a JSON Schema object")
            specs.append(ToolSpec(name, description, parameters))
        return tuple(specs)

    def to_openai(self) -> dict:
        """The tool as OpenAI writes it (what HF chat templates iterate over as ``tools``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolChoiceMode(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"   # one named function


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None   # the function, for FUNCTION

    @classmethod
    def parse(cls, value: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
        """OpenAI's ``tool_choice``: "none" | "auto" | "required" | {"type": "function", "function": {"name"}};
        absent means auto when there are tools, none when there are not."""
        if value is None:
            return cls(ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE)
        if isinstance(value, str) and value in ("none", "auto", "required"):
            mode = ToolChoiceMode(value)
            if mode is ToolChoiceMode.REQUIRED and not tools:
                raise RequestError("tool_choice \"required\" needs at least one tool in tools")
            return cls(mode if tools else ToolChoiceMode.NONE)
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
            name = value["function"].get("name")
            if not any(t.name == name for t in tools):
                known = ", ".join(t.name for t in tools) or "none"
                raise RequestError(f"tool_choice.function.name {name!r} is not one of the tools (given: {known})")
            return cls(ToolChoiceMode.FUNCTION, name)
        raise RequestError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")

    @property
    def is_forced(self) -> bool:
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION)


# ---- the history a template is given --------------------------------------------------------------------

def template_tools(fmt: ChatFormat, tools: tuple[ToolSpec, ...]) -> list[dict] | None:
    """The ``tools`` variable for the template: OpenAI's list where the template speaks a tool format, None
    for GENERIC (``template_messages`` describes the tools in a system message instead)."""
    if not tools or not _is_native(fmt):
        return None
    return [t.to_openai() for t in tools]


def template_messages(fmt: ChatFormat, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> list[dict]:
    """OpenAI messages as the chat template is given them.  Where the template takes tools: an assistant's
    tool_calls carry their arguments as objects (under ``function`` and at the top level, for both kinds of
    template) and a tool message keeps role "tool" with its call's ``name``.  Otherwise (GENERIC): the tools are
    described in the first system message, calls become the envelope's JSON text and a tool message a user
    message ``{"tool_response": {...}}``; with no tools offered (tool_choice none), both are plain words ("I
    called the tool ...", "The tool ... returned: ...").  RequestError names the message that is wrong."""
    native = _is_native(fmt)
    out: list[dict] = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role")
        role, content = message.get("role"), message.get("content")
        if content is not None and not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or null")
        if role == "assistant":
            calls = _history_calls(message.get("tool_calls"), where)
            if content is None and not calls:
                raise RequestError(f"{where} is an assistant message with neither content nor tool_calls")
            call_names.update((call_id, name) for call_id, name, _ in calls)
            out.append(_assistant(fmt, native, content, calls, message.get("reasoning_content"), plain=not tools))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_names:
                raise RequestError(f"{where}.tool_call_id {call_id!r} matches no tool call of an earlier assistant "
                                   "message")
            if native:
                out.append({"role": "tool", "tool_call_id": _template_call_id(fmt, call_id),
                            "name": call_names[call_id], "content": content or ""})
            elif not tools:  # why: with no tools offered, plain words; a small model answers them, not echoes JSON
                out.append({"role": "user", "content": f"The tool {call_names[call_id]} returned: {content or ''}"})
            else:  # why: small templates know only system/user/assistant
                response = {"tool_call_id": call_id, "name": call_names[call_id], "content": content or ""}
                out.append({"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)})
        else:
            if content is None:
                raise RequestError(f"{where}.content must be a string")
            out.append({"role": role, "content": content})
    if tools and not native:
        prompt = generic_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def generic_tools_prompt(tools: tuple[ToolSpec, ...]) -> str:
    """The system prompt that describes the tools and the reply envelope to a template without a tool format
    (after llama-server's generic format)."""
    lines = ["You can call the tools below. Respond in JSON format, either with `tool_calls` (a request to call "
             "tools) or with `response` (your reply to the user's request):",
             '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}',
             'or {"response": "<your reply>"}', "", "Tools:"]
    lines += [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                         ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def _is_native(fmt: ChatFormat) -> bool:
    return fmt.template_takes_tools and fmt.tools is not ToolFormat.GENERIC


def _history_calls(tool_calls: object, where: str) -> list[tuple[str, str, dict]]:
    """An assistant message's tool_calls as (id, name, arguments object)."""
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                               "\"arguments\"}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise RequestError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{at}.function.arguments must be a JSON object")
        calls.append((call["id"], function["name"], arguments))
    return calls


def _assistant(fmt: ChatFormat, native: bool, content: str | None, calls: list[tuple[str, str, dict]],
               reasoning: object, plain: bool = False) -> dict:
    if not calls:
        message = {"role": "assistant", "content": content}
    elif plain and not native:
        said = "; ".join(f"I called the tool {name} with {json.dumps(arguments, ensure_ascii=False)}."
                         for _, name, arguments in calls)
        message = {"role": "assistant", "content": f"{content}\n{said}" if content and content.strip() else said}
    elif native:
        # why: HF templates read either tool_call.function.{name,arguments} or tool_call.{name,arguments},
        # and render the arguments with tojson, so they get an object, not OpenAI's JSON string
        message = {"role": "assistant", "content": content or "", "tool_calls": [
            {"id": _template_call_id(fmt, call_id), "type": "function",
             "function": {"name": name, "arguments": arguments}, "name": name, "arguments": arguments}
            for call_id, name, arguments in calls]}
    else:
        envelope = json.dumps({"tool_calls": [{"name": name, "arguments": arguments} for _, name, arguments in calls]},
                              ensure_ascii=False)
        text = f"{content}\n{envelope}" if content and content.strip() else envelope
        message = {"role": "assistant", "content": text}
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    return message


def _template_call_id(fmt: ChatFormat, call_id: str) -> str:
    """The id a template is shown.  # why: Mistral's templates refuse ids that are not 9 alphanumerics."""
    if fmt.tools is not ToolFormat.MISTRAL or (len(call_id) == 9 and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


# ---- the reply ------------------------------------------------------------------------------------------

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


class ReplyParser:
    """Reads a reply as it is generated: ``feed`` returns the deltas each piece of text makes, ``flush`` the
    ones held back until the end (a possible marker's start, whitespace before a call), ``finish`` the Reply.

    ``tools_active``: calls in ``fmt.tools``'s syntax are read as calls; ``envelope``: the reply is the GENERIC
    JSON envelope (a grammar forces it).  ``tool_names``: the names that make a call (None: any)."""

    def __init__(self, fmt: ChatFormat, tools_active: bool, envelope: bool = False, *,
                 tool_names: Iterable[str] | None = None):
        self._out = _Collector()
        names = None if tool_names is None else frozenset(tool_names)
        self._think = _ThinkSplitter(fmt.think, fmt.opens_thinking) if fmt.think else None
        if tools_active and envelope:
            self._body: _Body = _EnvelopeBody(self._out, names)
        elif tools_active and fmt.tools is not ToolFormat.GENERIC:
            self._body = _MarkerBody(fmt.tools, self._out, names)
        else:
            self._body = _PlainBody(self._out)
        self._is_plain = self._think is None and isinstance(self._body, _PlainBody)
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


class _Collector:
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


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (what to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


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
                keep = self.buf if final else self.buf[:len(self.buf) - _partial_suffix(self.buf, end)]
                ready = keep.rstrip()
                out.append((True, ready))
                self.buf = "" if final else self.buf[len(ready):]
                return out
            else:
                if self.buf:
                    out.append((False, self.buf))
                self.buf = ""
                return out


class _Body:
    def feed(self, text: str, final: bool) -> None:
        raise NotImplementedError


class _PlainBody(_Body):
    def __init__(self, out: _Collector):
        self.out = out

    def feed(self, text: str, final: bool) -> None:
        self.out.content(text)


class _ObjectScanner:
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


class _CallReader:
    """One call's JSON object as it arrives: its START once the name is known (and allowed), then its arguments
    as they stream (an arguments object streams as its raw text; one given as a JSON string, or missing, comes
    whole at the end, as compact JSON)."""

    def __init__(self, out: _Collector, names: frozenset[str] | None):
        self.scan = _ObjectScanner()
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


class _MarkerBody(_Body):
    """Content with calls in HERMES, LLAMA3 or MISTRAL syntax.  A bare call (LLAMA3's ``{``, MISTRAL's ``[{``)
    is recognised where the body starts or right after a call: a control-token opener may not reach the text."""

    def __init__(self, fmt: ToolFormat, out: _Collector, names: frozenset[str] | None):
        self.fmt, self.out, self.names = fmt, out, names
        self.buf = ""
        self.state = "text"
        self.can_be_bare = fmt in (ToolFormat.LLAMA3, ToolFormat.MISTRAL)
        self.after_call = False
        self.reader: _CallReader | None = None
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
        ready = buf[:len(buf) - _partial_suffix(buf, opener)].rstrip()
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
            self.reader = _CallReader(self.out, self.names)
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


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ENVELOPE_KEY = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*(?=\S)')
_MAX_KEY = 256        # an envelope key longer than this is not one of ours
_LOW_SURROGATE_START = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")


class _EnvelopeBody(_Body):
    """The GENERIC envelope: ``{"response": "..."}`` streams its decoded string as content; ``{"tool_calls":
    [...]}`` (or llama-server's ``{"tool_call": {...}}``) gives calls.  A reply that is no envelope at all is
    content; one cut off keeps what was decoded (and a cut-off call's text, as content)."""

    def __init__(self, out: _Collector, names: frozenset[str] | None):
        self.out, self.names = out, names
        self.seen = ""          # all text so far, for a reply that turns out to be no envelope
        self.buf = ""
        self.state = "open"     # open, key, response, after, element, call, done, plain
        self.reader: _CallReader | None = None
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
            self.buf, self.state, self.value = rest, "response_value", _ValueScanner()
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
                char, n = _unescape(buf, i)
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
        self.reader = _CallReader(self.out, self.names)
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


class _ValueScanner:
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


def _unescape(buf: str, i: int) -> tuple[str, int]:
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
