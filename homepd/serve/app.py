"""The FastAPI application of one ``Service``: routes, OpenAI-shaped errors, key, body bound, optional CORS.

The engine starts in the background when the app starts (the port answers at
once: ``/health`` 200, ``/ready`` 503 until the model is warm) and stops when
the app shuts down.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from homepd.serve import advice_routes, embeddings, ops_routes, openai_routes
from homepd.serve.errors import install_error_handlers
from homepd.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware, HostCheckMiddleware
from homepd.serve.ollama import chat_routes, embed_routes, model_routes
from homepd.serve.ollama.errors import OllamaErrorShape

# why: a prompt of max_prompt_bytes may arrive JSON-escaped (\uXXXX: 6 bytes per character)
BODY_BYTES_PER_PROMPT_BYTE = 6
BODY_OVERHEAD_BYTES = 64 << 10
# why: a message is a few JSON values (object, role, content, parts); parsing is ~1 s per million values
JSON_VALUES_PER_MESSAGE = 16
JSON_VALUES_OVERHEAD = 1024


def create_app(service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(service.start())
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await service.stop()

    settings = service.settings
    app = FastAPI(title="homepd", summary="OpenAI-compatible LLM service of a homepd engine", version="0.1.0",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.include_router(openai_routes.router)
    app.include_router(embeddings.router)
    for ollama in (model_routes, chat_routes, embed_routes):  # the Ollama API on the same port
        app.include_router(ollama.router)
    app.include_router(ops_routes.router)
    app.include_router(advice_routes.router)
    install_error_handlers(app)

    # added innermost first: CORS (when on) answers preflights before the key is asked for
    app.add_middleware(BodyLimitMiddleware,
                       max_body_bytes=settings.max_prompt_bytes * BODY_BYTES_PER_PROMPT_BYTE + BODY_OVERHEAD_BYTES,
                       max_json_values=settings.max_messages * JSON_VALUES_PER_MESSAGE + JSON_VALUES_OVERHEAD)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if not settings.api_key or settings.allowed_hosts:  # without a key: loopback names (and the allowed) only
        app.add_middleware(HostCheckMiddleware, allowed_hosts=settings.allowed_hosts)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", openai_routes.CLASS_HEADER])
    app.add_middleware(OllamaErrorShape)  # outermost: every error under /api/ in Ollama's shape
    return app
