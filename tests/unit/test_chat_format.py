"""homepd.chat.format: detecting a template's format, the typed tool request, the history a template
is given (rendered through the real templates, written out here), and the reply parser, fed whole and in
every chunking."""
from __future__ import annotations

import json
import random

import pytest
from homepd.engine.prompt import render_chat

from homepd.chat.format import (PLAIN, ChatFormat, ThinkMarkers, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec,
                                    detect, template_messages, template_tools)
from homepd.chat.reply import Delta, DeltaKind, Reply
from homepd.chat.parser import ReplyParser
from homepd.errors import RequestError

# ---- real templates (as the GGUFs carry them) ------------------------------------------------------------

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3's hybrid template, abridged to its tool and thinking parts: thinking is the model's own unless
# enable_thinking is false, when the generation prompt writes an empty, closed block
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# a thinking-only model's template (Qwen3-2507-Thinking, DeepSeek-R1): the generation prompt opens the block
QWEN3_THINKING = QWEN3.replace("""    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}""", """    {{- '<|im_start|>assistant\\n<think>\\n' }}""")

THINK = ThinkMarkers("<think>", "</think>")
HERMES = ChatFormat(ToolFormat.HERMES, True, None, False)
QWEN3_FMT = ChatFormat(ToolFormat.HERMES, True, THINK, False)
OPENS = ChatFormat(ToolFormat.HERMES, True, THINK, True)
LLAMA3 = ChatFormat(ToolFormat.LLAMA3, True, None, False)
MISTRAL = ChatFormat(ToolFormat.MISTRAL, True, None, False)
GENERIC = ChatFormat(ToolFormat.GENERIC, False, None, False)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = ToolSpec.parse_all([WEATHER, TIME])
NAMES = ("get_weather", "get_time")


def render(template: str, messages: list[dict], **context) -> str:
    """The template rendered as homepd renders it (``homepd.engine.prompt.render_chat``: transformers' tojson)."""
    tools = context.pop("tools", None)
    return render_chat(template, messages, "<s>", "</s>", True, tools=tools, template_kwargs=context or None)


# ---- detect ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template,expected", [
    (QWEN25, ChatFormat(ToolFormat.HERMES, True, None, False)),
    (LLAMA31, ChatFormat(ToolFormat.LLAMA3, True, None, False)),
    (MISTRAL_V03, ChatFormat(ToolFormat.MISTRAL, True, None, False)),
    (QWEN3, ChatFormat(ToolFormat.HERMES, True, THINK, False)),
    (QWEN3_THINKING, ChatFormat(ToolFormat.HERMES, True, THINK, True)),
    (SMOLLM2, ChatFormat(ToolFormat.GENERIC, False, None, False)),
    (None, PLAIN),
    ("", PLAIN),
], ids=["qwen2.5", "llama3.1", "mistral", "qwen3", "qwen3-thinking", "smollm2", "none", "empty"])
def test_detect_reads_the_format_from_the_template(template, expected):
    assert detect(template) == expected


def test_detect_opens_thinking_from_a_deepseek_style_generation_prompt():
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
                "{# answers may carry </think> #}")
    assert detect(template) == ChatFormat(ToolFormat.GENERIC, False, THINK, True)


def test_a_marker_in_a_template_that_reads_no_tools_is_generic():
    # the marker only in a string: the template never reads a tools variable, so it cannot describe them
    template = "{{ '<tool_call> is how builtin_tools and message.tools are written' }}{{ messages[0]['content'] }}"
    assert detect(template).tools is ToolFormat.GENERIC
    assert not detect(template).template_takes_tools


def test_control_texts_name_the_markers_a_detokenizer_must_keep():
    assert detect(QWEN3).control_texts == ("<think>", "</think>", "<tool_call>", "</tool_call>")
    assert detect(MISTRAL_V03).control_texts == ("[TOOL_CALLS]",)
    assert detect(LLAMA31).control_texts == ("<|python_tag|>",)
    assert detect(SMOLLM2).control_texts == ()


# ---- the request's tools ---------------------------------------------------------------------------------

def test_tools_parse_into_specs_with_default_parameters():
    assert TOOLS[0] == ToolSpec("get_weather", "Weather in a city", WEATHER["function"]["parameters"])
    assert TOOLS[1] == ToolSpec("get_time", "", {"type": "object", "properties": {}})
    assert ToolSpec.parse_all(None) == ()
    assert TOOLS[0].to_openai() == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["function"]["parameters"]}}


@pytest.mark.parametrize("tools,where", [
    ({"type": "function"}, "tools must be a list"),
    ([WEATHER, {"type": "code_interpreter"}], "tools[1].type"),
    ([{"type": "function", "function": "get_weather"}], "tools[0].function must be"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {}}], "tools[0].function.name"),
    ([WEATHER, TIME, WEATHER], "tools[2].function.name 'get_weather' is given to an earlier tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([TIME] * 129, "at most 128"),
])
def test_bad_tools_are_refused_naming_the_path(tools, where):
    with pytest.raises(RequestError, match=None) as err:
        ToolSpec.parse_all(tools)
    assert where in str(err.value)


def test_tool_choice_parses_each_of_openais_forms():
    assert ToolChoice.parse(None, TOOLS) == ToolChoice(ToolChoiceMode.AUTO)
    assert ToolChoice.parse(None, ()) == ToolChoice(ToolChoiceMode.NONE)
    assert ToolChoice.parse("none", TOOLS) == ToolChoice(ToolChoiceMode.NONE)
    assert ToolChoice.parse("auto", ()) == ToolChoice(ToolChoiceMode.NONE)
    assert ToolChoice.parse("required", TOOLS).is_forced
    named = ToolChoice.parse({"type": "function", "function": {"name": "get_time"}}, TOOLS)
    assert named == ToolChoice(ToolChoiceMode.FUNCTION, "get_time") and named.is_forced


@pytest.mark.parametrize("value,message", [
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name 'nope' is not one of the tools"),
    ("always", "tool_choice must be"),
    ({"type": "function"}, "tool_choice must be"),
    ("function", "tool_choice must be"),
])
def test_bad_tool_choice_is_refused_naming_the_field(value, message):
    with pytest.raises(RequestError) as err:
        ToolChoice.parse(value, TOOLS)
    assert message in str(err.value)


def test_required_without_tools_is_refused():
    with pytest.raises(RequestError, match="needs at least one tool"):
        ToolChoice.parse("required", ())


# ---- the history a template is given ---------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "18C, cloudy"},
]


def test_native_history_parses_arguments_and_names_the_tool_message():
    out = template_messages(HERMES, HISTORY, TOOLS)
    call = out[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert (call["name"], call["arguments"], call["id"]) == ("get_weather", {"city": "Paris"}, "call_abc123")
    assert out[1]["content"] == ""
    assert out[2] == {"role": "tool", "tool_call_id": "call_abc123", "name": "get_weather", "content": "18C, cloudy"}
    assert "tool_calls" not in out[0]
    assert template_tools(HERMES, TOOLS) == [t.to_openai() for t in TOOLS]
    assert template_tools(GENERIC, TOOLS) is None


def test_native_history_renders_in_qwen25_and_qwen3():
    for template in (QWEN25, QWEN3):
        fmt = detect(template)
        text = render(template, template_messages(fmt, HISTORY, TOOLS), tools=template_tools(fmt, TOOLS))
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<tool_response>\n18C, cloudy\n</tool_response>" in text
        assert '"name": "get_time"' in text and text.endswith("<|im_start|>assistant\n")


def test_native_history_renders_in_llama31():
    fmt = detect(LLAMA31)
    text = render(LLAMA31, template_messages(fmt, HISTORY, TOOLS), tools=template_tools(fmt, TOOLS))
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text
    assert "Environment: ipython" in text


def test_mistral_history_gets_nine_character_ids_that_match():
    fmt = detect(MISTRAL_V03)
    out = template_messages(fmt, HISTORY, TOOLS)
    call_id = out[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and out[2]["tool_call_id"] == call_id
    text = render(MISTRAL_V03, out, tools=template_tools(fmt, TOOLS))
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{call_id}"}}]' in text
    assert f'"call_id": "{call_id}"}}[/TOOL_RESULTS]' in text


def test_generic_history_describes_the_tools_and_writes_the_envelope():
    out = template_messages(GENERIC, HISTORY, TOOLS)
    assert out[0]["role"] == "system" and "Respond in JSON format" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"] and '"required": ["city"]' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert out[3]["role"] == "user"
    assert json.loads(out[3]["content"]) == {"tool_response": {"tool_call_id": "call_abc123", "name": "get_weather",
                                                               "content": "18C, cloudy"}}
    text = render(SMOLLM2, out)
    assert "You are a helpful AI assistant named SmolLM" not in text   # our system message came first
    assert text.count("<|im_start|>") == 5


def test_generic_merges_the_tools_into_an_existing_system_message():
    out = template_messages(GENERIC, [{"role": "system", "content": "Be brief."}] + HISTORY, TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\nYou can call the tools below.")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert template_messages(GENERIC, [{"role": "user", "content": "hi"}], ()) == [{"role": "user", "content": "hi"}]


def test_an_assistant_message_with_content_and_calls_keeps_both():
    history = [dict(HISTORY[1], content="Let me look.")]
    assert template_messages(HERMES, history)[0]["content"] == "Let me look."
    content = template_messages(GENERIC, history, TOOLS)[1]["content"]  # after the tools system message
    assert content.startswith("Let me look.\n{\"tool_calls\"")
    # no tools offered (tool_choice none): plain words, which a small model answers instead of echoing JSON
    plain = template_messages(GENERIC, history + [HISTORY[2]])
    assert plain[0]["content"].startswith("Let me look.\nI called the tool get_weather with {")
    assert plain[1] == {"role": "user", "content": f"The tool get_weather returned: {HISTORY[2]['content']}"}


@pytest.mark.parametrize("messages,message", [
    ([HISTORY[0], {"role": "tool", "tool_call_id": "call_zzz", "content": "x"}],
     "messages[1].tool_call_id 'call_zzz' matches no tool call"),
    ([HISTORY[0], {"role": "assistant", "content": None}], "messages[1] is an assistant message with neither"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls[0] must be"),
    ([{"role": "user", "content": None}], "messages[0].content must be a string"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or null"),
])
def test_bad_history_is_refused_naming_the_message(messages, message):
    for fmt in (HERMES, GENERIC):
        with pytest.raises(RequestError) as err:
            template_messages(fmt, messages, TOOLS)
        assert message in str(err.value)


# ---- the reply parser ------------------------------------------------------------------------------------

def parse(fmt: ChatFormat, text: str, chunks: list[int] | None = None, tools_active: bool = True,
          envelope: bool = False, names=NAMES) -> tuple[Reply, list[Delta]]:
    parser = ReplyParser(fmt, tools_active, envelope, tool_names=names)
    deltas: list[Delta] = []
    i = 0
    for n in chunks or [len(text)]:
        deltas += parser.feed(text[i:i + n])
        i += n
    deltas += parser.feed(text[i:])
    deltas += parser.flush()
    return parser.finish(), deltas


def shape(reply: Reply) -> tuple:
    """A Reply without its random call ids."""
    return reply.content, reply.reasoning, tuple((c.name, c.arguments) for c in reply.tool_calls)


def check_deltas(reply: Reply, deltas: list[Delta], is_cut: bool = False) -> None:
    """The deltas add up to the Reply: content, reasoning, and each call's start and arguments (except a call
    cut off after its start was streamed: a delta cannot be taken back, the Reply has it as content)."""
    assert "".join(d.text for d in deltas if d.kind is DeltaKind.CONTENT) == (reply.content or "")
    assert "".join(d.text for d in deltas if d.kind is DeltaKind.REASONING) == (reply.reasoning or "")
    if is_cut:
        return
    starts = [d for d in deltas if d.kind is DeltaKind.TOOL_CALL_START]
    assert [(d.id, d.name) for d in starts] == [(c.id, c.name) for c in reply.tool_calls]
    assert [d.index for d in starts] == list(range(len(starts)))
    for d, call in zip(starts, reply.tool_calls):
        assert "".join(a.text for a in deltas if a.kind is DeltaKind.TOOL_CALL_ARGS and a.index == d.index) \
            == call.arguments


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [
    ("hermes-text-then-call", HERMES, f"Let me check.\n{CALL}", {}),
    ("hermes-two-calls", HERMES, f'{CALL}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>\n', {}),
    ("hermes-nested-args", HERMES, '<tool_call>{"name":"get_time","arguments":{"a":[1,{"b":"}\\"{"}],"c":null}}'
                                   '</tool_call>', {}),
    ("hermes-cut", HERMES, 'Sure <tool_call>\n{"name": "get_weather", "argum', {}),
    ("hermes-unknown-tool", HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> ok', {}),
    ("hermes-text-after", HERMES, f"{CALL}\nDone < soon.", {}),
    ("hermes-lookalike", HERMES, "a <tool b <tool_cal c</tool_call> <", {}),
    ("qwen3-reasoning-and-call", QWEN3_FMT, f"<think>\nI could write <tool_call> here.\n</think>\n\n{CALL}", {}),
    ("qwen3-reasoning-and-content", QWEN3_FMT, "<think>\nhmm\n</think>\n\nParis is sunny.", {}),
    ("qwen3-no-reasoning", QWEN3_FMT, "  Paris <b>is</b> sunny.", {}),
    ("opens-reasoning", OPENS, "\nthinking </thin> still\n</think>\n\nAnswer.", {}),
    ("opens-cut-in-reasoning", OPENS, "thinking about it </thi", {}),
    ("llama3-bare", LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', {}),
    ("llama3-python-tag", LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {}}', {}),
    ("llama3-json-answer", LLAMA3, '{"answer": 42} is the JSON', {}),
    ("mistral-marker", MISTRAL, 'On it. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                '{"name": "get_time", "arguments": {}}]', {}),
    ("mistral-bare", MISTRAL, '[{"name": "get_time", "arguments": {"tz": "UTC"}}]', {}),
    ("mistral-cut-second", MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_w', {}),
    ("envelope-response", GENERIC, '{"response": "He said \\"hi\\" \\ud83d\\ude00 caf\\u00e9\\n\\\\ done"}',
     {"envelope": True}),
    ("envelope-calls", GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                '{"name": "get_time", "arguments": {}}]}', {"envelope": True}),
    ("envelope-single", GENERIC, '{"tool_call": {"name": "get_time", "arguments": {"tz": "UTC"}}}',
     {"envelope": True}),
    ("envelope-cut", GENERIC, '{"response": "It is sunny in Par', {"envelope": True}),
    ("envelope-not-json", GENERIC, "Sunny, 18C.", {"envelope": True}),
    ("plain", GENERIC, "Just <tool_call> text.", {"tools_active": False}),
]
EXPECTED = {
    "hermes-text-then-call": ("Let me check.", None, (("get_weather", '{"city": "Paris"}'),)),
    "hermes-two-calls": (None, None, (("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
    "hermes-nested-args": (None, None, (("get_time", '{"a":[1,{"b":"}\\"{"}],"c":null}'),)),
    "hermes-cut": ('Sure <tool_call>\n{"name": "get_weather", "argum', None, ()),
    "hermes-unknown-tool": ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> ok', None, ()),
    "hermes-text-after": ("\nDone < soon.", None, (("get_weather", '{"city": "Paris"}'),)),
    "hermes-lookalike": ("a <tool b <tool_cal c</tool_call> <", None, ()),
    "qwen3-reasoning-and-call": (None, "I could write <tool_call> here.", (("get_weather", '{"city": "Paris"}'),)),
    "qwen3-reasoning-and-content": ("Paris is sunny.", "hmm", ()),
    "qwen3-no-reasoning": ("  Paris <b>is</b> sunny.", None, ()),
    "opens-reasoning": ("Answer.", "thinking </thin> still", ()),
    "opens-cut-in-reasoning": (None, "thinking about it </thi", ()),
    "llama3-bare": (None, None, (("get_weather", '{"city": "Paris"}'),)),
    "llama3-python-tag": (None, None, (("get_time", "{}"),)),
    "llama3-json-answer": ('{"answer": 42} is the JSON', None, ()),
    "mistral-marker": ("On it.", None, (("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
    "mistral-bare": (None, None, (("get_time", '{"tz": "UTC"}'),)),
    "mistral-cut-second": ('{"name": "get_w', None, (("get_time", "{}"),)),
    "envelope-response": ('He said "hi" \U0001F600 café\n\\ done', None, ()),
    "envelope-calls": (None, None, (("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
    "envelope-single": (None, None, (("get_time", '{"tz": "UTC"}'),)),
    "envelope-cut": ("It is sunny in Par", None, ()),
    "envelope-not-json": ("Sunny, 18C.", None, ()),
    "plain": ("Just <tool_call> text.", None, ()),
}


@pytest.mark.parametrize("name,fmt,text,kwargs", CASES, ids=[c[0] for c in CASES])
def test_a_reply_parses_the_same_in_any_chunking(name, fmt, text, kwargs):
    is_cut = name in ("hermes-cut", "mistral-cut-second")
    whole, deltas = parse(fmt, text, **kwargs)
    assert shape(whole) == EXPECTED[name]
    check_deltas(whole, deltas, is_cut)
    chunkings = [[1] * len(text)] + [[random.Random(seed).randint(1, 7) for _ in text] for seed in range(12)]
    for chunks in chunkings:
        reply, deltas = parse(fmt, text, chunks, **kwargs)
        assert shape(reply) == shape(whole), chunks
        check_deltas(reply, deltas, is_cut)


def test_a_marker_split_at_every_point_never_leaks_into_content():
    text = f"<think>ab</think>Hi{CALL}"
    for cut in range(1, len(text)):
        reply, deltas = parse(QWEN3_FMT, text, [cut])
        assert shape(reply) == ("Hi", "ab", (("get_weather", '{"city": "Paris"}'),)), cut
        assert all("<" not in d.text for d in deltas if d.kind is DeltaKind.CONTENT), cut


def test_a_surrogate_pair_split_at_every_point_decodes_whole():
    text = '{"response": "x\\ud83d\\ude00y"}'
    for cut in range(1, len(text)):
        for second in range(1, len(text) - cut):
            reply, _ = parse(GENERIC, text, [cut, second], envelope=True)
            assert reply.content == "x\U0001F600y", (cut, second)


def test_parallel_calls_get_numbered_starts_and_unique_ids():
    text = CALL + "\n" + CALL.replace("get_weather", "get_time")
    reply, deltas = parse(HERMES, text, [1] * len(text))
    starts = [d for d in deltas if d.kind is DeltaKind.TOOL_CALL_START]
    assert [(d.index, d.name) for d in starts] == [(0, "get_weather"), (1, "get_time")]
    assert len({c.id for c in reply.tool_calls}) == 2
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in reply.tool_calls)


def test_arguments_stream_as_they_arrive():
    parser = ReplyParser(HERMES, True, tool_names=NAMES)
    got = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [d.kind for d in got] == [DeltaKind.TOOL_CALL_START, DeltaKind.TOOL_CALL_ARGS]
    assert got[1].text == '{"ci'
    assert [d.text for d in parser.feed('ty": "Par')] == ['ty": "Par']
    assert [d.text for d in parser.feed('is"}}\n</tool_')] == ['is"}']
    assert parser.feed("call>") == [] and parser.flush() == []
    assert parser.finish().tool_calls[0].arguments == '{"city": "Paris"}'


def test_arguments_given_as_a_json_string_come_whole_and_compact():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    reply, deltas = parse(HERMES, text)
    assert reply.tool_calls[0].arguments == '{"city":"Paris"}'
    check_deltas(reply, deltas)


def test_reasoning_streams_as_it_arrives():
    parser = ReplyParser(QWEN3_FMT, False)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nstep one") == [Delta(DeltaKind.REASONING, "step one")]
    assert parser.feed(" then</th") == [Delta(DeltaKind.REASONING, " then")]
    assert parser.feed("ink>\n\nDone") == [Delta(DeltaKind.CONTENT, "Done")]
    assert shape(parser.finish()) == ("Done", "step one then", ())


def test_a_plain_reply_is_one_delta_per_piece():
    parser = ReplyParser(GENERIC, False)
    assert parser.feed("a <think>") == [Delta(DeltaKind.CONTENT, "a <think>")]
    assert parser.feed("") == []
    assert parser.finish() == Reply("a <think>", None, ())
    assert ReplyParser(GENERIC, False).finish() == Reply(None, None, ())


def test_any_tool_name_makes_a_call_when_names_are_not_given():
    reply, _ = parse(HERMES, '<tool_call>{"name": "anything", "arguments": {}}</tool_call>', names=None)
    assert shape(reply) == (None, None, (("anything", "{}"),))


def test_an_envelope_answer_that_is_a_json_value_streams_as_its_text():
    """response_format beside tools: the envelope's response is the structured answer itself."""
    text = '{"response": {"city": "Paris", "tags": ["a", "}"]}}'
    whole = ReplyParser(detect(None), tools_active=True, envelope=True).finish()
    parser = ReplyParser(detect(None), tools_active=True, envelope=True)
    streamed = [d.text for ch in text for d in parser.feed(ch)] + [d.text for d in parser.flush()]
    assert json.loads("".join(streamed)) == {"city": "Paris", "tags": ["a", "}"]}
    assert parser.finish().content == '{"city": "Paris", "tags": ["a", "}"]}' and not parser.finish().tool_calls
    assert whole.content is None
