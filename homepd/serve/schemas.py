"""OpenAI request bodies as pydantic models: strict types for every field homepd reads, leniency for the rest.

A field homepd does not know is accepted and ignored, as vLLM (``extra="allow"``)
and Ollama do: clients and proxies add their own (``metadata``, ``keep_alive``,
...).  Each is listed in the response's ``homepd.ignored_fields`` and counted in
``homepd_ignored_fields_total{field}``; ``--strict-fields`` makes it a 400 again.
A known field keeps its strict type and range (``"max_tokens": true`` or
``"temperature": "0.5"`` is a 400, not coerced; an integer is still a valid
float), and text must be valid Unicode (a lone surrogate is a 400 naming the
field).  Sampling follows llama-server's defaults where a request is silent
(``homepd.serve.generation.DEFAULTS``); llama-server's extensions (``top_k``,
``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``grammar``, ``json_schema``)
are accepted beside OpenAI's fields.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from homepd.core.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from homepd.serve.settings import REQUEST_CLASSES

MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32


def _unicode_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: a lone surrogate ({value[exc.start]!r}) at character "
                         f"{exc.start}; send UTF-8 text (a surrogate only as half of a \\uD8xx\\uDCxx pair)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]
NonEmpty = Annotated[Text, Field(min_length=1)]
MAX_STOP_CHARS = 1024  # a stop string is held back as it may be starting: its length bounds every token's cost
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _bounded_stop(v):
    if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return v


# a request's stop strings, the OpenAI and the Ollama bodies alike: one string or at most MAX_STOP_STRINGS
Stop = Annotated[Union[StopText, list[StopText], None], AfterValidator(_bounded_stop)]


class _Lenient(BaseModel):
    """Strict types, unknown fields kept aside (``ignored_fields``)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The dotted paths of every field this body (and the bodies inside it) does not know."""
        out = [prefix + name for name in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Lenient):
                    where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                    out += item.ignored_fields(where)
        return out


class ContentPart(_Lenient):
    """One part of a message's content; only ``text`` parts can reach a text-only model (the route says so
    for the others, naming the part: ``model_not_multimodal``)."""
    type: NonEmpty
    text: Text | None = None

    @model_validator(mode="after")
    def _text_part(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        return self


class FunctionCall(_Lenient):
    name: NonEmpty
    arguments: Text = Field(description="the call's arguments as a JSON string")


class ToolCallIn(_Lenient):
    """A tool call in an assistant message of the history."""
    id: NonEmpty
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = None
    name: Annotated[Text, Field(max_length=256)] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    reasoning_content: Text | None = Field(None, description="an assistant turn's reasoning (dropped from the "
                                                             "history, as reasoning templates do)")

    @model_validator(mode="after")
    def _shape(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far on every chunk (vLLM's extension)")


class JsonSchemaFormat(_Lenient):
    name: Annotated[Text, Field(max_length=64)] = "response"
    description: Text | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="llama-server's json_object + schema")

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with its 'schema'")
        return self


class _Sampling(_Lenient):
    """The fields both completion routes share."""
    model: Annotated[Text, Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="at most this many generated tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="0 = off (llama-server's extension)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="0 = off (llama-server's extension)")
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0, description="1 = off (llama-server's extension)")
    repeat_last_n: int | None = Field(None, ge=-1, le=1 << 16, description="tokens the penalties look back "
                                                                           "over; -1 = the context (extension)")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]; -100 bans")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Stop = None
    n: int | None = Field(None, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="generate exactly max_tokens: every end-of-generation token is "
                                                "banned, as llama-server does (benchmarks; extension)")
    user: Text | None = Field(None, max_length=256, description="accepted and not used")
    request_class: Literal[REQUEST_CLASSES] | None = Field(  # type: ignore[valid-type]
        None, description="interactive or background (extension; also the X-Homepd-Class header)")
    grammar: Annotated[Text, Field(min_length=1)] | None = Field(None, description="a GBNF grammar "
                                                                                    "(llama-server's extension)")
    json_schema: dict[str, Any] | None = Field(None, description="a JSON schema the output follows "
                                                                 "(llama-server's extension)")

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v not in (None, 1):
            raise ValueError(f"n={v!r}: homepd returns one choice per request; send n=1 (or none) and repeat the "
                             "request for more")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in v.items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"key {key[:40]!r} is not a token id: logit_bias maps this model's token ids "
                                 "(as strings, e.g. {\"1234\": -100}) to a bias")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {key}: bias {bias} is outside [-100, 100]")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give one of grammar and json_schema")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    def n_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = Field(None, description="more than one call in a reply (default false, as "
                                                                   "llama-server: small models repeat a call)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="passed to the chat template "
                                                                          "(e.g. enable_thinking)")
    reasoning_effort: Annotated[Text, Field(max_length=32)] | None = Field(
        None, description="passed to the chat template as reasoning_effort")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs(cls, v):
        if v is not None and len(v) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} entries")
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(v or ())
        if reserved:
            raise ValueError(f"{sorted(reserved)[0]!r} is set by homepd, not by chat_template_kwargs")
        return v

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; give one")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.response_format is not None and self.response_format.type != "text" and \
                (self.grammar is not None or self.json_schema is not None):
            raise ValueError("give one of response_format, grammar and json_schema")
        return self

    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Union[Text, list[Text]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the legacy shape: top n per token")
    echo: bool = Field(False, description="only false")
    suffix: Text | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="only 1")
    response_format: ResponseFormat | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("homepd takes one prompt per request (a string, or a list of exactly one)")
        return v

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _not_implemented(cls, v, info):
        """Legacy fields homepd accepts only where they change nothing (never silently ignored otherwise)."""
        if info.field_name == "best_of" and v not in (None, 1):
            raise ValueError("best_of: homepd returns one choice per request (only 1)")
        if info.field_name != "best_of" and v:
            raise ValueError({"echo": "echo=true is not supported by homepd (the prompt is not returned)",
                              "suffix": "suffix (fill-in-the-middle) is not supported by homepd"}[info.field_name])
        return v

    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    def n_logprobs(self) -> int | None:
        return self.logprobs
