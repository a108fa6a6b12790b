"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, never a bare 500.

``APIError`` is what routes raise; ``install_error_handlers`` maps pydantic's
validation errors (malformed JSON, a bad or unsupported field: 400 naming it;
a body that is not sent as JSON: 400 ``invalid_content_type``), the
framework's (a body it cannot parse, JSON nested too deeply among them: 400
``invalid_json``; an unknown route), homepd's own errors (a prompt longer
than the context: 400 ``exceed_context_size_error`` with ``n_prompt_tokens``
and ``n_ctx``) and anything unexpected onto it.
"""
from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from homepd.core.admission import AdmissionRejected
from homepd.errors import EngineError, HomepdError, PromptTooLongError, RequestError

log = logging.getLogger("homepd.serve")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable_error"  # 503: not ready, draining, queue full, a worker restarting
SERVER = "server_error"
UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "constrained-str"})
MAX_MESSAGE_CHARS = 1000  # an error message never quotes more of the request than this


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body; ``extra`` adds fields to the error object."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None, **extra):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "... (cut)"
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers, self.extra = headers or {}, extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    """A 503 with Retry-After: the client may try again later."""
    return APIError(503, message, UNAVAILABLE, code, headers={"Retry-After": str(retry_after_s)})


def from_homepd_error(exc: HomepdError) -> APIError:
    """homepd's errors as API errors: what the caller got wrong is a 400, a broken engine a 503."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "exceed_context_size_error", "context_length_exceeded", "messages",
                        n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx)
    if isinstance(exc, AdmissionRejected):  # early rejection: it would miss its TTFT budget now
        return unavailable(str(exc), "admission_rejected", retry_after_s=max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), INVALID_REQUEST, "invalid_value")
    if isinstance(exc, EngineError):
        return unavailable(str(exc), "engine_failed", retry_after_s=10)
    return APIError(500, str(exc), SERVER, "internal_error")


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None, str]:
    """pydantic's error list -> (message naming each field, the first field's name, code)."""
    parts, first, code = [], None, "invalid_value"

    def field_of(err: dict) -> str:
        # why: a union reports each member it tried as a loc part ('str', 'list[TextPart]'); name the field only
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and x not in UNION_TAGS and "[" not in str(x)]
        return ".".join(loc) or "body"

    fields = [field_of(err) for err in errors]
    # a union member's type mismatch ("not a string") says less than another member's error inside the field
    errors = [err for err, field in zip(errors, fields) if not (str(err.get("type", "")).endswith("_type") and any(
        other.startswith(field + ".") for other in fields))]
    for err in errors[:5]:
        field = field_of(err)
        first = first or field
        if err.get("type") == "json_invalid":
            code = "invalid_json"
            parts.append(f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        elif err.get("type") == "extra_forbidden":
            code = "unsupported_field"
            parts.append(f"{field}: unsupported field (homepd does not implement it; remove it)")
        elif err.get("type") == "missing":
            code = "missing_field"
            parts.append(f"{field}: required field missing")
        else:
            parts.append(f"{field}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), first, code


def is_json_media_type(content_type: str | None) -> bool:
    """True for what FastAPI parses as JSON: ``application/json`` or ``application/*+json``, with parameters."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def content_type_error(content_type: str | None, errors: list[dict]) -> APIError | None:
    """The error for a body the framework did not read as JSON because of its Content-Type (pydantic then
    finds no object at ``body``), or None."""
    if is_json_media_type(content_type) or not any(tuple(err.get("loc", ())) == ("body",) for err in errors):
        return None
    # why: a JSON route takes no text/plain or form body, as a browser may send one cross-site without asking
    sent = f"Content-Type {content_type[:64]!r}" if content_type else "no Content-Type"
    return APIError(400, f"the request body must be a JSON object sent with 'Content-Type: application/json' "
                         f"(this request had {sent})", INVALID_REQUEST, "invalid_content_type", "Content-Type")


def from_http_exception(exc: StarletteHTTPException) -> APIError:
    """The framework's HTTP errors, each with a code: a body it could not parse (``raise ... from`` the parser's
    error) is 400 ``invalid_json``."""
    cause, status = exc.__cause__, exc.status_code
    if status == 400 and isinstance(cause, RecursionError):
        return APIError(400, "the request body is JSON nested too deeply to parse; nest it less",
                        INVALID_REQUEST, "invalid_json")
    if status == 400 and cause is not None:
        return APIError(400, f"the request body could not be parsed as JSON ({type(cause).__name__}: {cause})",
                        INVALID_REQUEST, "invalid_json")
    kind = {401: AUTHENTICATION, 404: NOT_FOUND}.get(status, INVALID_REQUEST)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    return APIError(status, str(exc.detail), kind, code, headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        error = content_type_error(request.headers.get("content-type"), exc.errors())
        if error is None:
            message, param, code = describe_validation_errors(exc.errors())
            error = APIError(400, message, INVALID_REQUEST, code, param)
        service = getattr(request.app.state, "service", None)
        if service is not None:
            service.metrics.rejected.labels(error.code).inc()
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return from_http_exception(exc).response()

    @app.exception_handler(HomepdError)
    async def homepd_error(request: Request, exc: HomepdError):
        return from_homepd_error(exc).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug: logged, still OpenAI-shaped
        log.exception("homepd: unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error ({type(exc).__name__}); see the service log", SERVER,
                        "internal_error").response()
