"""One OpenAI request through the engine: admission, sampling, the response or its SSE stream.

Chat and text completions differ in how a choice is shaped (``Shape``) and in
what the reply holds: a chat's text goes through its ``ReplyParser``
(``homepd.chat.format``) into content, reasoning (``reasoning_content``)
and tool calls (``homepd.serve.reply``, which the Ollama routes read too;
``start_request`` is their way in).  The request is admitted before its prompt is tokenized; a
client that goes away has its request cancelled (streaming: starlette cancels
the generator; non-streaming: a watcher on the connection), and the place it
held is freed once the engine has ended it.  Every response carries homepd's
timings in the ``homepd`` field (the final chunk, when streaming), with the
fields it ignored.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from homepd.core.records import FinishReason
from homepd.core.sampling import SamplingParams, TokenLogprob
from homepd.core.terms import RequestClass
from homepd.engine.streams import EventKind
from homepd.errors import HomepdError, ModelError
from homepd.measure.trace.traffic import Route
from homepd.serve.chat import plan_request
from homepd.serve.errors import UNAVAILABLE, APIError, from_homepd_error, unavailable
from homepd.serve.loader import LoadFailed, LoadWaitTimeout, ModelTooLarge
from homepd.serve.middleware import cut
from homepd.serve.registry import QueueFull
from homepd.serve.reply import CHAT, TEXT, Reply, chat_logprobs, collect, completion_logprobs, release, usage
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("homepd.serve")
MESSAGE_OVERHEAD_BYTES = 16       # counted per message toward --max-prompt-bytes: about ChatML's markup


@dataclass(frozen=True)
class SamplerDefaults:
    """What a request that says nothing is sampled with: llama-server's defaults (``common_params_sampling``),
    which small local models are tuned for; stated in ``/v1/models`` and ``/status``."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


DEFAULTS = SamplerDefaults()


async def complete(service, request: Request, body: ChatCompletionRequest | CompletionRequest, request_class: RequestClass):
    """Run ``body`` on the service's engine: a JSON response, or an SSE stream when ``body.stream``."""
    reply = await start_request(service, body, request_class)
    if body.stream:
        usage_mode = "continuous" if body.continuous_usage else "final" if body.include_usage else None
        return EngineEventStream(service, reply.stream, request_class, _sse(reply, usage_mode))
    return await _respond(reply, request, request_class)


async def start_request(service, body: ChatCompletionRequest | CompletionRequest, request_class: RequestClass, *,
                        ignored: list[str] | None = None) -> Reply:
    """Check, plan, admit and submit ``body``: the ``Reply`` whose stream the engine now fills.  A face that
    maps its own wire format onto an OpenAI body (the Ollama routes) passes the fields it ``ignored``."""
    shape = CHAT if isinstance(body, ChatCompletionRequest) else TEXT
    settings = service.settings
    card = service.models.find(body.model)
    if card is not None and card.role != "chat":
        raise APIError(400, f"model {cut(body.model)!r} is an embedding model: it cannot chat or complete text; "
                            "send it to /v1/embeddings", code="model_not_chat", param="model")
    if card is None and service.models.is_multi:
        raise APIError(404, f"model {cut(body.model)!r} is not served here; the models are "
                            f"{service.models.known_names()} (GET /v1/models)", "not_found_error",
                       "model_not_found", "model")
    if settings.strict_model_name and card is None and body.model not in service.served_model_ids:
        raise APIError(404, f"model {cut(body.model)!r} is not served here; GET /v1/models lists "
                            f"{', '.join(service.served_model_ids)}", "not_found_error", "model_not_found", "model")
    ignored = service.ignored_fields(body.ignored_fields() if ignored is None else ignored)
    if messages_count := len(getattr(body, "messages", ())):
        if messages_count > settings.max_messages:
            raise APIError(413, f"{messages_count} messages; this service takes at most {settings.max_messages} "
                                "(--max-messages)", code="too_many_messages", param="messages")
    n_bytes = _prompt_bytes(body)
    if n_bytes > settings.max_prompt_bytes:
        raise APIError(413, f"the prompt is {n_bytes} bytes; this service takes at most "
                            f"{settings.max_prompt_bytes} (--max-prompt-bytes)", code="prompt_too_large",
                       param="messages" if shape.is_chat else "prompt")
    slot = service.models.slot_of(card)
    if service.state == "starting" and slot is service.models.default:
        # why: loading; the chat format (the plan's input) is not known yet
        code, message = service.unavailable_reason() or ("not_ready", "the model is still loading; retry shortly")
        raise unavailable(message, code, retry_after_s=5)
    await service.until_admitting()  # why: a switch of configuration under way (homepd.serve.switch) holds it
    service.check_open()
    load_s = await lease(service, slot)
    rid = shape.id_prefix + uuid.uuid4().hex
    try:
        engine = slot.engine
        model_name = service.served_model_ids[0] if slot is service.models.default else slot.name
        plan = await plan_request(body, sampling_params(body, settings, slot.config.n_ctx), engine.chat_format,
                                  model_name)
        service.admit(rid, request_class, engine)
    except BaseException:
        service.models.release(slot)
        raise
    service.models.bind(rid, slot)  # why: from here the lease ends with the request (service.finished)
    try:
        stream = await engine.submit(plan.prompt, messages=plan.messages, params=plan.params,
                                     request_id=rid, request_class=request_class, chat=plan.chat)
    except HomepdError as exc:
        service.finished(rid, None, request_class)
        error = from_homepd_error(exc)
        if error.status < 500:
            service.metrics.rejected.labels(error.code or error.type).inc()
        raise error from None
    service.note_arrival(stream, Route.CHAT if shape.is_chat else Route.COMPLETIONS, plan.params.max_tokens,
                         plan.prompt, plan.messages)
    return Reply(service, shape, stream, plan, body.model, int(time.time()), ignored, engine=engine, load_s=load_s)


async def lease(service, slot) -> float:
    """A lease on ``slot``'s model for one request (loading it on demand); the seconds waited for the load.
    What stops it is an API error: the model's queue full or no room made in time (503), a model too large
    for the memory budget (507, with the bytes), a failed load (503, with its reason)."""
    # why only with several models: one model's queue is the service's, which admission bounds as before
    capacity = service.model_capacity(slot.config) if slot.is_chat and service.models.is_multi else None
    try:
        return await service.models.acquire(slot, capacity)
    except HomepdError as exc:
        error = lease_error(exc)
        service.metrics.rejected.labels(error.code or error.type).inc()
        raise error from None


def lease_error(exc: HomepdError) -> APIError:
    """The API error of a lease that could not be had (``lease``)."""
    if isinstance(exc, ModelTooLarge):
        return APIError(507, str(exc), "insufficient_storage_error", "model_too_large", "model",
                        needed_bytes=exc.needed_bytes, budget_bytes=exc.budget_bytes)
    if isinstance(exc, QueueFull):
        return unavailable(str(exc), "queue_full")
    if isinstance(exc, LoadWaitTimeout):
        return unavailable(str(exc), "no_room", retry_after_s=10)
    if isinstance(exc, (LoadFailed, ModelError)):
        return unavailable(str(exc), "model_load_failed", retry_after_s=10)
    return from_homepd_error(exc)


def _prompt_bytes(body) -> int:
    """The request's text toward --max-prompt-bytes; each message costs its template's markup too, so empty
    messages are not free, and a tool call's arguments count."""
    if isinstance(body, CompletionRequest):
        return len(body.prompt_text().encode())
    total = 0
    for m in body.messages:
        total += len((m.text() or "").encode()) + MESSAGE_OVERHEAD_BYTES
        for call in m.tool_calls or ():
            total += len(call.function.arguments.encode()) + len(call.function.name)
    return total + (len(json.dumps(body.tools).encode()) if body.tools else 0)


def sampling_params(body, settings, n_ctx: int) -> SamplingParams:
    """The engine's sampling parameters for ``body`` (llama-server's defaults where it is silent; the grammar
    comes with the plan)."""
    max_tokens = body.asked_max_tokens()
    if max_tokens is not None and max_tokens > settings.max_tokens:
        raise APIError(400, f"max_tokens={max_tokens} exceeds this service's limit of {settings.max_tokens} "
                            "(--max-tokens)", code="invalid_value", param="max_tokens")
    pick = lambda value, default: default if value is None else value  # noqa: E731
    repeat_last_n = pick(body.repeat_last_n, DEFAULTS.repeat_last_n)
    params = SamplingParams(
        max_tokens=max_tokens or settings.max_tokens,
        temperature=float(pick(body.temperature, DEFAULTS.temperature)),
        top_k=pick(body.top_k, DEFAULTS.top_k), top_p=float(pick(body.top_p, DEFAULTS.top_p)),
        min_p=float(pick(body.min_p, DEFAULTS.min_p)), seed=body.seed, stop=body.stop_strings(),
        ignore_eos=body.ignore_eos, repeat_penalty=float(pick(body.repeat_penalty, DEFAULTS.repeat_penalty)),
        repeat_last_n=n_ctx if repeat_last_n == -1 else repeat_last_n,
        presence_penalty=float(body.presence_penalty or 0.0), frequency_penalty=float(body.frequency_penalty or 0.0),
        logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        n_logprobs=body.n_logprobs())
    try:
        return params.validated()
    except HomepdError as exc:
        raise from_homepd_error(exc) from None


async def _respond(reply: Reply, request: Request, request_class: RequestClass):
    """The whole answer as one OpenAI response."""
    last = await collect(reply, request, request_class)
    stream = reply.stream
    choice: dict = {"index": 0}
    if reply.shape.is_chat:
        choice["message"] = reply.message()
        choice["logprobs"] = chat_logprobs(reply.logprobs) if reply.plan.params.n_logprobs is not None else None
    else:
        choice["text"] = "".join(reply.content)
        choice["logprobs"] = completion_logprobs(reply.logprobs) if reply.plan.params.n_logprobs is not None \
            else None
    choice["finish_reason"] = reply.finish_reason(last.finish_reason)
    return JSONResponse({
        "id": stream.request_id, "object": reply.shape.object, "created": reply.created, "model": reply.model,
        "choices": [choice], "usage": usage(stream.lifecycle), "homepd": reply.homepd()})


async def _sse(reply: Reply, usage_mode: str | None):
    """The SSE body: a chunk per delta, a final chunk with the finish reason and timings, the usage chunk
    when asked (``stream_options.include_usage``), then ``data: [DONE]``.  ``usage_mode``: None, "final"
    (``usage`` null on every chunk but the last) or "continuous" (the usage so far on every chunk)."""
    shape, stream = reply.shape, reply.stream
    n_out = 0
    wants_logprobs = reply.plan.params.n_logprobs is not None

    def chunk(choices: list, **extra) -> bytes:
        so_far = usage(stream.lifecycle, n_out)
        body = {"id": stream.request_id, "object": shape.chunk_object, "created": reply.created,
                "model": reply.model, "choices": choices,
                **({"usage": so_far if usage_mode == "continuous" else None} if usage_mode else {}), **extra}
        return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))

    def piece(delta: dict | None, finish_reason: str | None = None, logprob: TokenLogprob | None = None) -> dict:
        out: dict = {"index": 0}
        if shape.is_chat:
            out["delta"] = delta or {}
            out["logprobs"] = chat_logprobs([logprob]) if logprob is not None else None
        else:
            out["text"] = (delta or {}).get("content", "")
            out["logprobs"] = completion_logprobs([logprob]) if logprob is not None else None
        out["finish_reason"] = finish_reason
        return out

    if shape.is_chat:
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for event in stream:
        n_out += event.kind is EventKind.TOKEN
        deltas = reply.feed(event.text, event.t_s)
        logprob = event.logprob if wants_logprobs else None
        if event.kind is EventKind.DONE and event.finish_reason is not FinishReason.CANCELLED:
            deltas += reply.flush(event.t_s)
        for i, delta in enumerate(deltas):
            yield chunk([piece(delta, logprob=logprob if i == 0 else None)])
        if logprob is not None and not deltas:
            yield chunk([piece(None, logprob=logprob)])
        if event.kind is EventKind.DONE and event.finish_reason is not FinishReason.CANCELLED:
            yield chunk([piece(None, reply.finish_reason(event.finish_reason))], homepd=reply.homepd())
            if usage_mode:
                yield chunk([], usage=usage(stream.lifecycle))
        elif event.kind is EventKind.ERROR:
            why = event.error or "aborted: homepd is shutting down"
            yield format_sse_event(data_str=json.dumps(APIError(
                503, f"the request failed: {why}", UNAVAILABLE, "worker_failed" if event.error else "aborted"
            ).body()))
        elif event.kind is EventKind.DONE:
            yield format_sse_event(data_str=json.dumps(APIError(
                503, "the request failed: aborted: homepd is shutting down", UNAVAILABLE, "aborted").body()))
    yield format_sse_event(data_str="[DONE]")


class EngineEventStream(EventSourceResponse):
    """The SSE response of one engine request, which frees the request however the response ends."""

    def __init__(self, service, stream, request_class: RequestClass, body):
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.service, self.stream, self.request_class = service, stream, request_class

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release(self.service, self.stream, self.request_class)
