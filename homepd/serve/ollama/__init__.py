"""The Ollama API, beside the OpenAI one on the same port: a face of its own on the same engine.

Home Assistant's ``ollama`` integration, Open WebUI's Ollama connection and Continue speak it.  The routes
follow Ollama's API as documented for ``OLLAMA_API_VERSION`` (``docs/api.md`` of that release), which
``/api/version`` reports: ``chat_routes`` (``/api/chat``, ``/api/generate``: mapped onto the engine's one chat
plan by ``mapping``, answered as NDJSON by ``ndjson``), ``model_routes`` (``/``, ``/api/version``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/pull`` and the 501s), ``embed_routes`` (``/api/embed``, ``/api/embeddings``),
``schemas`` (the bodies) and ``errors`` (``{"error": "..."}`` on every ``/api/`` route).
"""
from __future__ import annotations

# why this release: the API as it stood when `think` took levels and /api/ps gained context_length; the routes
# and fields homepd implements have not changed since (later releases run llama-server underneath, same API)
OLLAMA_API_VERSION = "0.13.0"

