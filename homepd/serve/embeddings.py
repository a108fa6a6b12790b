"""Embeddings: ``POST /v1/embeddings`` in OpenAI's shape, and what the Ollama routes share with it.

A request names a model; the service's embedding model (``--embedding-model``, ``homepd.engine.embedder``)
answers.  The chat model's name is a 400 (it is not an embedding model); another name is served by the
embedding model, as the chat routes serve any name (``--strict-model-name``: 404).  ``input`` is a string, a
list of strings, a list of token ids or a list of such lists; a request is bounded (``--max-embedding-inputs``
inputs and ``--max-prompt-bytes`` of text: 413), and requests queue on the model's thread, each answered in
turn (503 only past ``homepd.engine.embedder.DEFAULT_MAX_WAITING`` waiting).  Vectors are L2-normalised;
``dimensions`` keeps the first N and normalises again (as Ollama does); ``encoding_format: "base64"`` sends
little-endian float32, as OpenAI's client reads it.  An input longer than the model's context is a 400
unless ``truncate`` (homepd's extension here; Ollama's ``/api/embed`` cuts by default).
"""
from __future__ import annotations

import asyncio
import base64
import json
from typing import Annotated, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from homepd.engine.embedder import DEFAULT, EmbedQueueFull, Embeddings
from homepd.errors import HomepdError, ModelError, RequestError
from homepd.models.card import ModelCard
from homepd.serve.errors import APIError, unavailable
from homepd.serve.generation import lease
from homepd.serve.middleware import cut
from homepd.serve.registry import CHAT, EMBEDDING
from homepd.serve.schemas import Text, _Lenient

router = APIRouter(prefix="/v1", tags=["openai"])
OFF_LOOP_VALUES = 16_384   # vectors with more numbers than this are written to JSON off the event loop
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(_Lenient):
    model: Annotated[Text, Field(min_length=1)]
    input: Union[Text, list[Text], TokenIds, list[TokenIds]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of such lists")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions (normalised again)")
    user: Text | None = Field(None, max_length=256, description="accepted and not used")
    truncate: bool = Field(False, description="cut an input longer than the model's context instead of a 400 "
                                              "(extension)")


def embedding_card(service, name: str, *, strict: bool, not_found=None) -> ModelCard:
    """The embedding model a request's ``model`` names: a 400 for the chat model's name or a service with
    none, a 404 (``not_found(name)``, else OpenAI's) for an unknown name when ``strict``."""
    card = service.models.find(name)
    embedding = service.models.card(EMBEDDING)
    if card is not None and card.role == CHAT:
        raise APIError(400, f"model {cut(name)!r} is a chat model: it does not embed" +
                       (f"; this service embeds with {embedding.name}" if embedding else
                        "; start homepd serve with --embedding-model all-minilm-l6-v2 to embed"),
                       code="model_not_embedding", param="model")
    if card is None and strict:
        raise not_found(name) if not_found else APIError(
            404, f"model {cut(name)!r} is not served here; the models are {service.models.known_names()}",
            "not_found_error", "model_not_found", "model")
    if embedding is None:
        raise APIError(400, "this service has no embedding model: start homepd serve with --embedding-model "
                            "all-minilm-l6-v2 (a catalog name or a GGUF path)", code="model_not_embedding",
                       param="model")
    return card or embedding


def check_inputs(service, inputs: list, param: str = "input") -> None:
    """The request bound: at most ``--max-embedding-inputs`` inputs and ``--max-prompt-bytes`` of text (413)."""
    settings = service.settings
    if len(inputs) > settings.max_embedding_inputs:
        raise APIError(413, f"{len(inputs)} inputs; this service embeds at most {settings.max_embedding_inputs} "
                            "in one request (--max-embedding-inputs): send them in smaller batches",
                       code="too_many_inputs", param=param)
    n_bytes = sum(len(x.encode()) if isinstance(x, str) else 4 * len(x) for x in inputs)
    if n_bytes > settings.max_prompt_bytes:
        raise APIError(413, f"the inputs are {n_bytes} bytes; this service takes at most "
                            f"{settings.max_prompt_bytes} (--max-prompt-bytes)", code="prompt_too_large", param=param)


async def embed(service, inputs: list, *, truncate: bool, dimensions: int | None = None,
                keep_alive_s=DEFAULT, card: ModelCard | None = None) -> tuple[np.ndarray | None, Embeddings]:
    """Embed ``inputs`` on the service's embedding model; the vectors cut to ``dimensions`` (normalised
    again).  Errors as API errors: 400 for the input, 503 for a full queue, a draining service or a model
    that could not load."""
    if service.state in ("draining", "stopped", "failed"):
        code, message = service.unavailable_reason() or ("draining", "homepd is shutting down")
        raise unavailable(message, code, retry_after_s=30)
    card = card or service.models.card(EMBEDDING)
    slot = service.models.slot_of(card) if card is not None else None
    if slot is not None and slot.embedder is not None:  # why: its room under the memory budget, made first
        await lease(service, slot)
    try:
        result = await service.models.embedding_model(card).embed(inputs, truncate=truncate,
                                                                  keep_alive_s=keep_alive_s)
    except EmbedQueueFull as exc:
        service.metrics.rejected.labels("queue_full").inc()
        raise unavailable(str(exc), "queue_full") from None
    except RequestError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="input") from None
    except (ModelError, HomepdError) as exc:
        raise unavailable(f"the embedding model could not run: {exc}", "model_unavailable", retry_after_s=10) \
            from None
    finally:
        if slot is not None and slot.embedder is not None:
            service.models.release(slot)
    vectors = result.vectors
    if vectors is not None and dimensions is not None:
        if dimensions > vectors.shape[1]:
            raise APIError(400, f"dimensions={dimensions}: the model's vectors have {vectors.shape[1]}",
                           code="invalid_value", param="dimensions")
        vectors = vectors[:, :dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors, result


async def json_response(body: dict, n_values: int) -> Response:
    """``body`` as JSON, written off the event loop when it holds many numbers."""
    if n_values > OFF_LOOP_VALUES:
        text = await asyncio.to_thread(json.dumps, body, ensure_ascii=False)
    else:
        text = json.dumps(body, ensure_ascii=False)
    return Response(text, media_type="application/json")


@router.post("/embeddings", responses={400: {"description": "a chat model's name, no embedding model, an input "
                                                            "over the context (without truncate), a bad token"},
                                       413: {"description": "more inputs than --max-embedding-inputs"},
                                       503: {"description": "the embedding queue is full, or draining"}})
async def embeddings(body: EmbeddingRequest, request: Request):
    """Embeddings in OpenAI's shape (``data[].embedding``: floats, or base64 float32)."""
    service = request.app.state.service
    card = embedding_card(service, body.model, strict=service.settings.strict_model_name or service.models.is_multi)
    service.ignored_fields(body.ignored_fields())
    raw = body.input
    inputs = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not inputs:
        raise APIError(400, "input is empty: send a string or a non-empty list", code="invalid_value",
                       param="input")
    check_inputs(service, inputs)
    vectors, result = await embed(service, inputs, truncate=body.truncate, dimensions=body.dimensions, card=card)
    if body.encoding_format == "base64":
        rows = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        rows = vectors.tolist()
    n = result.n_prompt_tokens
    return await json_response({
        "object": "list", "model": body.model, "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]},
        vectors.size if body.encoding_format == "float" else 0)
