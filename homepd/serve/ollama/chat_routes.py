"""``POST /api/chat`` and ``POST /api/generate``: Ollama's generation routes on the service's engine.

Each finds the model the body names (404 ``model 'x' not found``; the embedding model is a 400), maps the body
onto an OpenAI body (``mapping``) and runs it through ``homepd.serve.generation.start_request``, the same
checks, plan, admission and engine as ``/v1/chat/completions``; the answer is NDJSON unless ``stream: false``
(``ndjson``).  A body without messages (or prompt) loads the model and answers ``done_reason: "load"``; with
``keep_alive: 0`` it answers ``"unload"`` (the chat model itself stays: it is this service's engine).  The
request class is the route's default (``--chat-class``), or the ``X-Homepd-Class`` header.
"""
from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from homepd.engine.embedder import DEFAULT
from homepd.models.card import ModelCard
from homepd.serve.errors import APIError
from homepd.serve.generation import start_request
from homepd.serve.ollama import ndjson
from homepd.serve.ollama.errors import ERROR_RESPONSES, find_model
from homepd.serve.ollama.mapping import chat_body, check_think, generate_body
from homepd.serve.ollama.schemas import ChatRequest, GenerateRequest, keep_alive_seconds
from homepd.serve.openai_routes import request_class
from homepd.serve.reply import collect
from homepd.serve.registry import CHAT

router = APIRouter(prefix="/api", tags=["ollama"])
LOAD_TIMEOUT_S = 300.0  # a load request waits this long for the chat model's engine to start


@router.post("/chat", responses=ERROR_RESPONSES)
async def chat(body: ChatRequest, request: Request, x_homepd_class: Annotated[str | None, Header()] = None):
    """A chat turn (NDJSON chunks unless ``stream: false``); no messages: load (``keep_alive: 0``: unload)."""
    service = request.app.state.service
    card = _chat_model(service, body.model, "chat")
    if not body.messages:
        return await _load(service, card, body, is_chat=True)
    return await _run(service, request, card, body, chat_body(body, card), True,
                      request_class(None, x_homepd_class, service.settings.chat_class))


@router.post("/generate", responses=ERROR_RESPONSES)
async def generate(body: GenerateRequest, request: Request, x_homepd_class: Annotated[str | None, Header()] = None):
    """A completion of ``prompt`` (NDJSON chunks unless ``stream: false``); no prompt: load (or unload)."""
    service = request.app.state.service
    card = service.models.find(body.model)
    if card is None:
        find_model(service, body.model)  # raises the 404
    if not body.prompt and not body.suffix:
        return await _load(service, card, body, is_chat=False)  # why: Open WebUI ejects any model so
    card = _chat_model(service, body.model, "generate")
    return await _run(service, request, card, body, generate_body(body, card), False,
                      request_class(None, x_homepd_class, service.settings.completions_class))


def _chat_model(service, name: str, what: str) -> ModelCard:
    card = find_model(service, name)
    if card.role != CHAT:
        raise APIError(400, f"{card.name!r} does not support {what}: it is an embedding model (use /api/embed)",
                       code="invalid_value", param="model")
    return card


async def _run(service, request: Request, card: ModelCard, body, openai_body, is_chat: bool, klass):
    keep_alive = keep_alive_seconds(body.keep_alive)
    load_s = await service.models.load(card, LOAD_TIMEOUT_S) if service.state == "starting" else 0.0
    reply = await start_request(service, openai_body, klass, ignored=body.ignored_fields())
    reply.model = body.model
    load_s += reply.load_s
    await service.models.keep_alive(card, keep_alive)
    if body.stream:
        return ndjson.NdjsonStream(service, reply, klass, ndjson.lines(reply, is_chat, load_s))
    last = await collect(reply, request, klass)
    return JSONResponse(ndjson.whole(reply, last.finish_reason, is_chat, load_s))


async def _load(service, card: ModelCard, body, is_chat: bool):
    """A request with nothing to generate: load the model, or unload it with ``keep_alive: 0``."""
    check_think(getattr(body, "think", None), card)
    keep_alive = keep_alive_seconds(body.keep_alive)
    if keep_alive == 0:
        await service.models.keep_alive(card, 0)
        answer = ndjson.done(is_chat, body.model, "unload")
    else:
        load_s = await service.models.load(card, LOAD_TIMEOUT_S)
        if keep_alive is not DEFAULT:
            await service.models.keep_alive(card, keep_alive)
        answer = ndjson.done(is_chat, body.model, "load", load_duration=int(load_s * ndjson.NS),
                             total_duration=int(load_s * ndjson.NS))
    if body.stream:
        return Response(json.dumps(answer) + "\n", media_type=ndjson.NDJSON)
    return JSONResponse(answer)
