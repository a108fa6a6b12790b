"""OpenAI request bodies as pydantic models: every field homepd reads, and every known field it refuses.

An unknown field is a 400 naming it (``extra="forbid"``); a known OpenAI field
that homepd does not implement is accepted only at its neutral value (``n=1``,
``logprobs=false``, penalties 0, ...) and is otherwise a 400 naming it, never
silently ignored.  Numbers out of range are 400s from the field constraints.
Types are strict (``"max_tokens": true`` or ``"temperature": "0.5"`` is a 400,
not coerced; an integer is still a valid float), and text must be valid
Unicode (a lone surrogate such as ``"\\ud800"`` is a 400 naming the field).
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from homepd.core.sampling import MAX_STOP_STRINGS
from homepd.serve.settings import REQUEST_CLASSES



def _unicode_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: a lone surrogate ({value[exc.start]!r}) at character "
                         f"{exc.start}; send UTF-8 text (a surrogate only as half of a \\uD8xx\\uDCxx pair)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]
NonEmpty = Annotated[str, Field(min_length=1)]
# known OpenAI fields homepd does not implement -> the neutral values it accepts for them
SAMPLING_NEUTRAL = {"n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                    "logit_bias": (None, {}), "logprobs": (None, False)}
CHAT_NEUTRAL = {"top_logprobs": (None, 0), "response_format": (None, {"type": "text"}), "tools": (None, []),
                "tool_choice": (None, "none")}
COMPLETION_NEUTRAL = {"echo": (False,), "suffix": (None,), "best_of": (None, 1)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _unicode_text(v) if isinstance(v, str) else v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far on every chunk (vLLM's extension)")


def _only_neutral(neutral: dict[str, tuple], value, name: str):
    """A known OpenAI field homepd does not implement passes only at its neutral value(s)."""
    if value not in neutral[name]:
        raise ValueError(f"{name}={value!r} is not supported by homepd (only "
                         f"{' or '.join(map(repr, neutral[name]))})")
    return value


class _Sampling(_Strict):
    """The fields both completion routes share."""
    model: Annotated[Text, Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="at most this many generated tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="0 = off (extension)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Union[NonEmpty, list[NonEmpty], None] = None
    n: int | None = Field(None, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (benchmarks; extension)")
    presence_penalty: float | None = Field(None, description="only 0")
    frequency_penalty: float | None = Field(None, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, description="only empty")
    logprobs: Union[bool, int, None] = Field(None, description="not supported")
    user: Text | None = Field(None, max_length=256, description="accepted and not used")
    request_class: Literal[REQUEST_CLASSES] | None = Field(  # type: ignore[valid-type]
        None, description="interactive or background (extension; also the X-Homepd-Class header)")

    @field_validator(*SAMPLING_NEUTRAL)
    @classmethod
    def _neutral(cls, v, info):
        return _only_neutral(SAMPLING_NEUTRAL, v, info.field_name)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return [_unicode_text(s) for s in v] if isinstance(v, list) else v if v is None else _unicode_text(v)

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, description="not supported")
    response_format: dict | None = Field(None, description="only {'type': 'text'}")
    tools: list[dict] | None = Field(None, description="not supported")
    tool_choice: Union[str, dict, None] = Field(None, description="only 'none'")
    parallel_tool_calls: bool | None = None

    @field_validator(*CHAT_NEUTRAL)
    @classmethod
    def _chat_neutral(cls, v, info):
        return _only_neutral(CHAT_NEUTRAL, v, info.field_name)

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; give one")
        return self

    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the engine's chat template takes them ('developer' is OpenAI's new 'system')."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str]]
    echo: bool = Field(False, description="only false")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="only 1")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("homepd takes one prompt per request (a string, or a list of exactly one)")
        return [_unicode_text(p) for p in v] if isinstance(v, list) else _unicode_text(v)

    @field_validator(*COMPLETION_NEUTRAL)
    @classmethod
    def _completion_neutral(cls, v, info):
        return _only_neutral(COMPLETION_NEUTRAL, v, info.field_name)

    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt
