"""Ollama's request bodies as pydantic models: strict types for what homepd reads, every other field accepted.

Ollama decodes JSON with Go's ``encoding/json``: a field it does not know is ignored, and so it is here (and
counted in ``homepd_ignored_fields_total``, listed in the log once); a known field keeps its type and range
(``"stream": "yes"``, ``"options": {"temperature": "hot"}`` are 400s naming the field).  The ``options`` Ollama
documents but homepd's sampler does not have (``mirostat``, ``tfs_z``, ``typical_p``, ``num_gpu``, ...) are
accepted and counted as ignored, as unknown keys are.  ``keep_alive`` is a Go duration (``"5m"``, ``"1h30m"``,
``"-1s"``) or seconds (a number); negative means for good, 0 means unload.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from homepd.engine.embedder import DEFAULT
from homepd.serve.schemas import MAX_TOOLS, Stop, Text, _Lenient

ModelName = Annotated[Text, Field(min_length=1, max_length=512)]
KeepAlive = Union[float, Annotated[Text, Field(max_length=64)], None]
ThinkLevel = Literal["high", "medium", "low"]
_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str | None, field_name: str = "keep_alive") -> float | None | object:
    """``keep_alive`` in seconds: None for good (negative), 0 to unload, or ``DEFAULT`` (not given).
    ValueError names what a duration looks like."""
    if value is None:
        return DEFAULT
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    text = value.strip()
    if re.fullmatch(r"-?[0-9]*\.?[0-9]+", text):
        return keep_alive_seconds(float(text))
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    parts = _GO_DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"{field_name} {value[:40]!r} is not a duration: send seconds (300, -1) or a Go "
                         "duration (\"5m\", \"1h30m\", \"-1s\")")
    seconds = sign * sum(float(n) * _UNITS_S[u] for n, u in parts)
    return None if seconds < 0 else seconds


class Options(_Lenient):
    """The ``options`` homepd's sampler reads (llama.cpp's names, as Ollama's); others are ignored."""
    num_ctx: int | None = Field(None, ge=1, description="accepted; the model's loaded context serves (no reload)")
    num_predict: int | None = Field(None, ge=-2, description="-1: until done; -2: until the context is full")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=1 << 16)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="negative: a random seed")
    stop: Stop = None


class _Generating(_Lenient):
    """What /api/chat and /api/generate share."""
    model: ModelName
    stream: bool = True
    format: Union[Literal["", "json"], dict[str, Any], None] = Field(
        None, description='"json", or a JSON schema the answer follows (the same grammars as response_format)')
    options: Options | None = None
    keep_alive: KeepAlive = None
    think: Union[bool, ThinkLevel, None] = None

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v):
        keep_alive_seconds(v)
        return v


class ToolCallFunction(_Lenient):
    name: Annotated[Text, Field(min_length=1)]
    arguments: dict[str, Any] = Field(default_factory=dict, description="an object, as Ollama sends it")
    index: int | None = None


class ToolCall(_Lenient):
    id: Text | None = None
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = ""
    images: list[Text] | None = None
    thinking: Text | None = Field(None, description="an assistant turn's reasoning (not sent back to the model)")
    tool_calls: list[ToolCall] | None = None
    tool_name: Annotated[Text, Field(max_length=256)] | None = None
    tool_call_id: Annotated[Text, Field(max_length=256)] | None = None


class ChatRequest(_Generating):
    messages: list[Message] | None = Field(None, description="none or empty: load the model (keep_alive 0: unload)")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)


class GenerateRequest(_Generating):
    prompt: Text | None = Field(None, description="none or empty: load the model (keep_alive 0: unload)")
    suffix: Text | None = Field(None, description="text after the insertion (fill-in-the-middle models only)")
    system: Text | None = None
    raw: bool = Field(False, description="the prompt as it is, without the chat template")
    images: list[Text] | None = None


class EmbedRequest(_Lenient):
    model: ModelName
    input: Union[Text, list[Text]] = Field(default_factory=list, description="empty: load the model")
    truncate: bool = Field(True, description="cut an input longer than the context (false: a 400)")
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: KeepAlive = None

    _keep_alive = field_validator("keep_alive")(_Generating._keep_alive.__func__)


class EmbeddingsRequest(_Lenient):
    """The legacy /api/embeddings: one ``prompt``, one ``embedding``."""
    model: ModelName
    prompt: Text = ""
    options: Options | None = None
    keep_alive: KeepAlive = None

    _keep_alive = field_validator("keep_alive")(_Generating._keep_alive.__func__)


class ShowRequest(_Lenient):
    model: ModelName | None = None
    name: ModelName | None = Field(None, description="the legacy key (Continue sends it)")
    verbose: bool = False

    def target(self) -> str | None:
        return self.model or self.name


class PullRequest(_Lenient):
    model: ModelName | None = None
    name: ModelName | None = Field(None, description="the legacy key")
    stream: bool = True
    insecure: bool = False

    def target(self) -> str | None:
        return self.model or self.name
