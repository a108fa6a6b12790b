"""Ollama's model routes: ``/`` and ``/api/version`` (is this Ollama?), ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/pull``, and the routes homepd answers 501 (delete, copy, create, push, blobs), naming what it does instead.

``/api/tags`` and ``/api/ps`` read the model registry only (``homepd.serve.registry``): no engine, file or
thread on the way, so they answer in milliseconds while the chat model loads (Home Assistant polls them every
30 s with a 5 s timeout).  ``/api/pull`` never downloads (the service never does): a catalog model already
here is verified (its sha256, off the loop) and answered as pulled; one that is not here is a 400 that says
to run ``homepd models pull``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from homepd.models.card import ModelCard
from homepd.models.catalog import load_catalog
from homepd.models.resolve import is_present, models_dir
from homepd.serve.errors import APIError
from homepd.serve.generation import DEFAULTS
from homepd.serve.middleware import cut
from homepd.serve.ollama import OLLAMA_API_VERSION
from homepd.serve.ollama.errors import ERROR_RESPONSES, find_model
from homepd.serve.ollama.ndjson import NDJSON
from homepd.serve.ollama.schemas import PullRequest, ShowRequest
from homepd.serve.registry import CHAT, ModelState

router = APIRouter(tags=["ollama"])
DESCRIBE_WAIT_S = 1.0    # /api/tags waits at most this long for the headers to be read (then: the catalog's card)
# the turn-end markers of common chat templates: /api/show's "stop" parameters, when the template writes one
END_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>")
_VERIFIED: set[tuple] = set()  # files whose sha256 matched, by (path, inode, size, mtime, sha256)
NOT_HERE = {
    "delete": "homepd does not delete models over its API: remove the file from the models directory "
              "(`homepd models list` shows it)",
    "copy": "homepd does not copy models: to serve a model under another name, start homepd serve with "
            "--served-model-name NAME",
    "create": "homepd does not create models from a Modelfile: serve a catalog model or any GGUF file with "
              "--model NAME_OR_PATH (sampling settings go in each request's options)",
    "push": "homepd does not push models: its models come from the Python package index (`homepd models pull`)",
    "blobs": "homepd takes no model uploads: copy a GGUF file onto the box and serve it with --model PATH",
}


@router.get("/", response_class=PlainTextResponse)
async def root():
    """What Ollama answers here (clients probe it)."""
    return "Ollama is running"


@router.head("/", include_in_schema=False)
async def root_head():
    return Response()


@router.get("/api/version")
async def version():
    """The Ollama API version these routes follow (dotted numbers: Open WebUI parses them as integers)."""
    return {"version": OLLAMA_API_VERSION}


@router.get("/api/tags")
async def tags(request: Request):
    """Every model this service serves, with its details."""
    models = request.app.state.service.models
    if not models.described.is_set():
        try:
            await asyncio.wait_for(models.described.wait(), DESCRIBE_WAIT_S)
        except asyncio.TimeoutError:
            pass
    return {"models": [{"name": c.name, "model": c.name, "modified_at": c.modified_at, "size": c.size_bytes,
                        "digest": c.digest, "details": details(c), "state": models.state(c).value}
                       for c in models.all()]}


@router.get("/api/ps")
async def ps(request: Request):
    """The loaded models: their size, ``size_vram`` (0 on the CPU), ``expires_at`` and context length."""
    service = request.app.state.service
    models, config = service.models, service.config
    on_gpu = config.gpu_index is not None and config.n_gpu_layers != 0
    def size(c) -> int:  # several models: what it takes loaded (measured, else planned); one: its file's size
        fp = models.slot_of(c).footprint
        return fp.footprint_bytes if models.is_multi and fp is not None else c.size_bytes

    return {"models": [{
        "name": c.name, "model": c.name, "size": size(c), "digest": c.digest, "details": details(c),
        "expires_at": models.expires_at(c).isoformat(), "size_vram": size(c) if on_gpu else 0,
        "context_length": models.context_length(c)} for c in models.all() if models.state(c) is ModelState.LOADED]}


@router.post("/api/show", responses=ERROR_RESPONSES)
async def show(body: ShowRequest, request: Request):
    """One model: details, ``model_info`` from its GGUF, ``parameters``, ``template`` and ``capabilities``."""
    service = request.app.state.service
    if body.target() is None:
        raise APIError(400, "model is required (send {\"model\": NAME}, or the legacy {\"name\": NAME})",
                       code="missing_field", param="model")
    card = find_model(service, body.target())
    return {"license": card.license, "modelfile": f"# served by homepd from {card.path or card.spec}\n",
            "parameters": parameters(card, service), "template": card.template or "", "details": details(card),
            "model_info": card.model_info, "capabilities": list(card.capabilities),
            "modified_at": card.modified_at}


@router.post("/api/pull", responses=ERROR_RESPONSES)
async def pull(body: PullRequest, request: Request):
    """A catalog model already here: verified and answered as pulled.  Nothing is downloaded."""
    service = request.app.state.service
    name = body.target()
    if name is None:
        raise APIError(400, "model is required", code="missing_field", param="model")
    catalog = load_catalog()
    entry = catalog.get(name.removesuffix(":latest"))
    if entry is None:
        raise APIError(404, f"model {cut(name, 200)!r} not found: homepd pulls catalog models only "
                            f"({', '.join(catalog)}; `homepd models list`)", "not_found_error", "model_not_found",
                       "model")
    directory = models_dir(service.config.models_dir)
    if not is_present(entry, directory):
        raise APIError(400, f"{entry.name} is not on this box, and homepd serve never downloads: run `homepd "
                            f"models pull {entry.name}` here (it fetches and verifies it), then ask again",
                       code="model_not_present", param="model")
    path = directory / entry.file_name
    if not body.stream:
        if not await asyncio.to_thread(_matches, path, entry.sha256):
            raise APIError(400, _damaged(entry.name), code="model_damaged", param="model")
        return {"status": "success"}
    return StreamingResponse(_pull_lines(path, entry), media_type=NDJSON)


async def _pull_lines(path: Path, entry):
    def line(obj: dict) -> bytes:
        return (json.dumps(obj) + "\n").encode()

    yield line({"status": "pulling manifest"})
    yield line({"status": f"pulling {entry.sha256[:12]}", "digest": f"sha256:{entry.sha256}",
                "total": entry.size_bytes, "completed": entry.size_bytes})
    yield line({"status": "verifying sha256 digest"})
    if not await asyncio.to_thread(_matches, path, entry.sha256):
        yield line({"error": _damaged(entry.name)})
        return
    yield line({"status": "writing manifest"})
    yield line({"status": "success"})


def _matches(path: Path, sha256: str) -> bool:
    """Whether the file hashes to ``sha256`` (remembered per version of the file: a pull of a present model
    is asked again and again by some clients)."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, sha256)
    if key in _VERIFIED:
        return True
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    if hasher.hexdigest() != sha256:
        return False
    _VERIFIED.add(key)
    return True


def _damaged(name: str) -> str:
    return f"{name} on this box does not match its catalog sha256: run `homepd models pull {name} --force`"


def _not_here(what: str):
    async def refuse():
        raise APIError(501, NOT_HERE[what], code="not_implemented")

    refuse.__doc__ = f"501: {NOT_HERE[what]}"
    return refuse


for _what, _methods in (("delete", ["DELETE", "POST"]), ("copy", ["POST"]), ("create", ["POST"]),
                        ("push", ["POST"])):
    # why out of the schema: a refusal is not an operation (and a fuzzer rightly calls every 5xx a failure)
    router.add_api_route(f"/api/{_what}", _not_here(_what), methods=_methods, include_in_schema=False)
router.add_api_route("/api/blobs/{digest}", _not_here("blobs"), methods=["HEAD", "POST"], include_in_schema=False)


def details(card: ModelCard) -> dict:
    family = card.family or card.architecture
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family],
            "parameter_size": card.parameter_size, "quantization_level": card.quantization_level}


def parameters(card: ModelCard, service) -> str:
    """Ollama's ``parameters`` text (one ``name value`` a line), as Continue reads ``num_ctx`` and ``stop``."""
    n_ctx = service.config.n_ctx if card.role == CHAT else card.context_length
    lines = [f"num_ctx {n_ctx}"] if n_ctx else []
    if card.role == CHAT:
        lines += [f"stop {json.dumps(m)}" for m in END_MARKERS if card.template and m in card.template]
        lines += [f"{k} {v:g}" for k, v in (("temperature", DEFAULTS.temperature), ("top_k", DEFAULTS.top_k),
                                            ("top_p", DEFAULTS.top_p), ("min_p", DEFAULTS.min_p),
                                            ("repeat_penalty", DEFAULTS.repeat_penalty),
                                            ("repeat_last_n", DEFAULTS.repeat_last_n))]
    return "\n".join(lines)
