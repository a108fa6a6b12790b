"""``POST /api/embed`` and the legacy ``POST /api/embeddings``: Ollama's embeddings on the service's embedding
model (``homepd.serve.embeddings``, which ``/v1/embeddings`` shares).

``/api/embed`` takes ``input`` (a string or a list; empty: load the model), ``truncate`` (default true: an
input longer than the context is cut to it), ``dimensions`` and ``keep_alive``, and answers ``embeddings``
(L2-normalised) with ``prompt_eval_count`` and the durations.  ``/api/embeddings`` takes one ``prompt`` and
answers one ``embedding`` (normalised too: Ollama's legacy route sends the raw vector; its direction is the
same).  A chat model's name is a 400, an unknown name a 404.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from homepd.serve.embeddings import check_inputs, embed, embedding_card, json_response
from homepd.serve.ollama.errors import ERROR_RESPONSES, find_model
from homepd.serve.ollama.ndjson import NS
from homepd.serve.ollama.schemas import EmbeddingsRequest, EmbedRequest, keep_alive_seconds

router = APIRouter(prefix="/api", tags=["ollama"])


def _card(service, name: str):
    find_model(service, name)
    return embedding_card(service, name, strict=True)


@router.post("/embed", responses=ERROR_RESPONSES)
async def embed_route(body: EmbedRequest, request: Request):
    """Embeddings of ``input`` (a string or a list of strings)."""
    service = request.app.state.service
    card = _card(service, body.model)
    service.ignored_fields(body.ignored_fields())
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    check_inputs(service, inputs)
    vectors, result = await embed(service, inputs, truncate=body.truncate, dimensions=body.dimensions,
                                  keep_alive_s=keep_alive_seconds(body.keep_alive), card=card)
    rows = vectors.tolist() if vectors is not None else []
    return await json_response({
        "model": body.model, "embeddings": rows, "total_duration": int(result.total_s * NS),
        "load_duration": int(result.load_s * NS), "prompt_eval_count": result.n_prompt_tokens},
        vectors.size if vectors is not None else 0)


@router.post("/embeddings", responses=ERROR_RESPONSES)
async def embeddings_route(body: EmbeddingsRequest, request: Request):
    """The legacy route: one ``prompt``, one ``embedding`` (an empty prompt: load the model)."""
    service = request.app.state.service
    card = _card(service, body.model)
    service.ignored_fields(body.ignored_fields())
    inputs = [body.prompt] if body.prompt else []
    check_inputs(service, inputs, "prompt")
    vectors, _ = await embed(service, inputs, truncate=True, keep_alive_s=keep_alive_seconds(body.keep_alive),
                             card=card)
    return {"embedding": vectors[0].tolist() if vectors is not None else []}
