"""Errors in Ollama's shape, ``{"error": "..."}``, for every route under ``/api/``.

The service raises one kind of error (``homepd.serve.errors.APIError``, OpenAI's shape) everywhere: in the
routes, in request validation, in the middleware (the API key, the Host check, the body bound).
``OllamaErrorShape``, the outermost middleware, rewrites an error response to a path under ``/api/`` into
Ollama's shape, keeping its status and headers, so an Ollama client reads the message as it reads Ollama's.
An unknown model is a 404 ``model 'x' not found``, as Ollama says it.
"""
from __future__ import annotations

import json

from homepd.models.card import ModelCard
from homepd.serve.errors import APIError, NOT_FOUND
from homepd.serve.middleware import cut

OLLAMA_PREFIX = "/api/"
ERROR_RESPONSES = {code: {"description": why, "content": {"application/json": {"example": {"error": "..."}}}}
                   for code, why in (
    (400, "a known field of the wrong type or out of range, a capability the model has not (think, images, "
          "suffix, an embedding model asked to chat or a chat model to embed), a prompt over the context"),
    (401, "missing or wrong API key"), (404, "model 'x' not found"), (413, "too many inputs or messages"),
    (503, "loading, draining, or the queue is full (Retry-After)"))}


def find_model(service, name: str) -> ModelCard:
    """The model ``name`` names, or Ollama's 404."""
    card = service.models.find(name)
    if card is None:
        raise APIError(404, f"model {cut(name, 200)!r} not found; the models here: {service.models.known_names()}",
                       NOT_FOUND, "model_not_found", "model")
    return card


class OllamaErrorShape:
    """Rewrite error responses (status >= 400, JSON in OpenAI's shape) under ``/api/`` to ``{"error": msg}``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(OLLAMA_PREFIX):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def shaped(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = ollama_body(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaped)


def ollama_body(body: bytes) -> bytes:
    """``{"error": {"message": m, ...}}`` as ``{"error": m}``; any other body as it is."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return json.dumps({"error": error["message"]}, ensure_ascii=False).encode()
    return body
