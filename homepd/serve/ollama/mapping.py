"""From an Ollama body to the OpenAI body the engine's chat plan is made from, and Ollama's 400s.

The Ollama routes do not plan requests of their own: they map ``/api/chat`` and ``/api/generate`` onto the
OpenAI request types (``homepd.serve.schemas``), which ``homepd.serve.generation.start_request`` plans with the
engine's one ``plan_chat`` / ``plan_completion`` (``homepd.engine.chatplan``), exactly as for the OpenAI routes.
What is Ollama's own is mapped here:

* messages: a tool call's ``arguments`` object becomes the JSON string the plan reads; calls get ids when the
  client sent none, and a tool result is matched to its call by ``tool_call_id``, else by ``tool_name``, else
  to the oldest unanswered call (Home Assistant sends results with neither);
* ``images`` on a text-only model are a 400 naming the message; ``format`` ``"json"`` or a schema is
  ``response_format``; ``think`` is the template's ``enable_thinking`` (a level is ``reasoning_effort`` too),
  and a 400 naming the model when it cannot think;
* ``options`` onto the sampler: ``num_predict`` (-1 and -2: until done, as far as ``--max-tokens`` allows),
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``,
  ``frequency_penalty``, ``seed`` (negative: random), ``stop``; ``num_ctx`` is accepted and changes nothing:
  the model serves with the context it was loaded with, and a prompt longer than that is a 400 naming both;
* ``/api/generate``: ``raw`` (or a model without a chat template) is a text completion of the prompt; otherwise
  the prompt is a user turn after the ``system`` text.  ``suffix`` needs a fill-in-the-middle model: none of
  homepd's is one, so a non-empty suffix is Ollama's 400 (``does not support insert``).
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from homepd.models.card import ModelCard
from homepd.serve.errors import APIError, describe_validation_errors
from homepd.serve.ollama.schemas import ChatRequest, GenerateRequest, Options
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                    "presence_penalty", "frequency_penalty")


def chat_body(body: ChatRequest, card: ModelCard) -> ChatCompletionRequest:
    """The OpenAI chat body of an Ollama chat with messages."""
    check_think(body.think, card)
    data = {"model": body.model, "messages": messages(body.messages or [], card), **common(body, card)}
    if body.tools:
        data["tools"] = body.tools
    return _validated(ChatCompletionRequest, data)


def generate_body(body: GenerateRequest, card: ModelCard) -> ChatCompletionRequest | CompletionRequest:
    """The OpenAI body of an Ollama generate with a prompt: a text completion when raw (or the model has no
    chat template), else a chat of one user turn."""
    if body.suffix:
        raise APIError(400, f"{body.model!r} does not support insert: suffix needs a fill-in-the-middle model",
                       code="invalid_value", param="suffix")
    if body.images:
        raise APIError(400, _no_vision(card, "images"), code="model_not_multimodal", param="images")
    check_think(body.think, card)
    has_no_template = card.path is not None and card.template is None  # a base model (the fake has one)
    if body.raw or has_no_template:
        data = {"model": body.model, "prompt": body.prompt or "", **common(body, card)}
        data.pop("chat_template_kwargs", None)
        data.pop("reasoning_effort", None)
        return _validated(CompletionRequest, data)
    turns = ([{"role": "system", "content": body.system}] if body.system else []) + \
        [{"role": "user", "content": body.prompt or ""}]
    return _validated(ChatCompletionRequest, {"model": body.model, "messages": turns, **common(body, card)})


def check_think(think, card: ModelCard) -> None:
    """``think`` true (or a level) on a model that cannot think is a 400 naming it; false is always fine."""
    if think not in (None, False) and "thinking" not in card.capabilities:
        raise APIError(400, f"{card.name!r} does not support thinking (its chat template has no reasoning "
                            "block); send think: false or none", code="invalid_value", param="think")


def common(body, card: ModelCard) -> dict:
    """The OpenAI fields of what chat and generate share: sampling, structured output, thinking, streaming."""
    data = sampling(body.options)
    data["stream"] = False  # why: the Ollama routes read the engine's stream themselves
    fmt = body.format
    if fmt == "json":
        data["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        data["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    if "thinking" in card.capabilities and body.think is not None:
        data["chat_template_kwargs"] = {"enable_thinking": body.think is not False}
        if isinstance(body.think, str):
            data["reasoning_effort"] = body.think
    return data


def sampling(options: Options | None) -> dict:
    """Ollama's ``options`` as the OpenAI body's sampling fields."""
    if options is None:
        return {}
    out = {name: getattr(options, name) for name in SAMPLING_OPTIONS if getattr(options, name) is not None}
    if options.num_predict is not None and options.num_predict > 0:
        out["max_tokens"] = options.num_predict
    if options.seed is not None and options.seed >= 0:
        out["seed"] = options.seed
    if options.stop:
        out["stop"] = options.stop
    return out


def messages(history: list, card: ModelCard) -> list[dict]:
    """Ollama's messages as the OpenAI message dicts ``plan_chat`` reads (tool calls with ids, each result
    matched to its call)."""
    out, pending = [], []  # pending: (id, name) of calls not answered yet, oldest first
    n_calls = 0
    for i, m in enumerate(history):
        if m.images:
            raise APIError(400, _no_vision(card, f"messages[{i}].images"), code="model_not_multimodal",
                           param=f"messages[{i}].images")
        turn: dict = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for call in m.tool_calls:
                n_calls += 1
                call_id = call.id or f"call_{n_calls}"
                pending.append((call_id, call.function.name))
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
            turn["tool_calls"] = calls
            turn["content"] = m.content or None
        elif m.role == "tool":
            answered = _match(pending, m.tool_call_id, m.tool_name)
            if answered is None:
                raise APIError(400, f"messages[{i}] is a tool result that answers no earlier tool call (send the "
                                    "assistant message with its tool_calls before it)", code="invalid_value",
                               param=f"messages[{i}]")
            pending.remove(answered)
            turn["tool_call_id"] = answered[0]
            if m.tool_name:
                turn["name"] = m.tool_name
        out.append(turn)
    return out


def _match(pending: list[tuple[str, str]], call_id: str | None, name: str | None) -> tuple[str, str] | None:
    if call_id is not None:
        return next((p for p in pending if p[0] == call_id), None)
    if name is not None:
        return next((p for p in pending if p[1] == name), pending[0] if pending else None)
    return pending[0] if pending else None


def _no_vision(card: ModelCard, where: str) -> str:
    return f"{where}: {card.name} is a text-only model: it has no vision input; send text only"


def _validated(cls, data: dict):
    """``data`` as the OpenAI body ``cls``; what it refuses is a 400 naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        message, param, code = describe_validation_errors(exc.errors())
        raise APIError(400, message, code=code, param=param) from None
