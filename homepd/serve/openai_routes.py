"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request

from homepd.core.terms import RequestClass
from homepd.serve.errors import APIError
from homepd.serve.generation import DEFAULTS, complete
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest
from homepd.serve.settings import REQUEST_CLASSES

router = APIRouter(prefix="/v1", tags=["openai"])
CLASS_HEADER = "X-Homepd-Class"
ERROR_RESPONSES = {code: {"description": why} for code, why in (
    (400, "malformed JSON, a known field of the wrong type or out of range, an unknown field with "
          "--strict-fields, a schema or grammar that cannot be enforced, a media part for a text-only model "
          "(model_not_multimodal), a prompt longer than the context (exceed_context_size_error)"),
    (401, "missing or wrong API key"), (404, "model not served here (--strict-model-name only)"), (413, "prompt over --max-prompt-bytes"),
    (503, "not ready, draining, queue full, a worker restarting, or rejected early by admission: predicted to "
          "miss its class's TTFT budget (Retry-After)"))}


def request_class(body_class: str | None, header_class: str | None, default: str = "interactive") -> RequestClass:
    """The request's class from the body field or the header (they must agree); else the route's default.  Parsed
    here, once: from the HTTP edge inward a class is a ``RequestClass``.

    A header sent twice arrives as one comma-separated value (``homepd.serve.middleware`` folds repeated
    headers): its values must agree too."""
    if header_class is not None:
        values = sorted({v.strip().lower() for v in header_class.split(",")} - {""}) or [""]
        if len(values) > 1:
            raise APIError(400, f"header {CLASS_HEADER} has more than one value ({', '.join(values)}): send it "
                                "once", code="invalid_value", param=CLASS_HEADER)
        header_class = values[0]
        if header_class not in REQUEST_CLASSES:
            raise APIError(400, f"header {CLASS_HEADER}: {header_class!r} is not one of {', '.join(REQUEST_CLASSES)}",
                           code="invalid_value", param=CLASS_HEADER)
        if body_class is not None and body_class != header_class:
            raise APIError(400, f"request_class {body_class!r} and header {CLASS_HEADER} {header_class!r} differ",
                           code="invalid_value", param="request_class")
    return RequestClass(body_class or header_class or default)


@router.post("/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           x_homepd_class: Annotated[str | None, Header()] = None):
    """A chat completion (``stream: true``: server-sent events ending with ``data: [DONE]``)."""
    service = request.app.state.service
    return await complete(service, request, body, request_class(body.request_class, x_homepd_class,
                                                                service.settings.chat_class))


@router.post("/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request,
                      x_homepd_class: Annotated[str | None, Header()] = None):
    """A text completion of one prompt (``stream: true``: server-sent events ending with ``data: [DONE]``)."""
    service = request.app.state.service
    return await complete(service, request, body, request_class(body.request_class, x_homepd_class,
                                                                service.settings.completions_class))


@router.get("/models")
async def models(request: Request):
    """Every model this service serves, with its state (unloaded, loading, loaded, draining): one chat model
    under its catalog name, its file name and each --served-model-name; several, each under its name."""
    service = request.app.state.service
    registry, created = service.models, int(service.started_wall_s)

    def entry(name: str, slot, **meta) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "homepd",
                "meta": {**meta, "role": slot.spec.role.value, "state": registry.state(slot.card).value}}

    data = []
    for slot in registry.slots.values():
        chat_meta = {"sampling_defaults": DEFAULTS.to_dict(), "multimodal": False} if slot.is_chat else {}
        if slot is registry.default and not registry.is_multi:
            data += [entry(name, slot, **chat_meta) for name in service.served_model_ids]
        else:
            fp = slot.footprint
            data.append(entry(slot.card.name.removesuffix(":latest"), slot, **chat_meta,
                              aliases=list(slot.card.aliases),
                              **({"n_ctx": slot.config.n_ctx} if slot.is_chat else {}),
                              footprint_bytes=fp.footprint_bytes if fp else None))
    return {"object": "list", "data": data}
