"""Chat formats: the tool-call and reasoning syntax a model's chat template speaks, the typed tool request,
and the history a template is given.

``detect`` reads a template's text once (``ChatFormat``).  The request side is typed here (``ToolSpec``,
``ToolChoice``); ``template_messages`` turns OpenAI messages into what the template renders.  The reply goes
the other way in ``homepd.chat.parser``; the grammars that make a model keep to these formats are
``homepd.llm.grammar``'s.  Pure: standard library only.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from enum import Enum

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
