"""One OpenAI request through the engine: admission, sampling, the response or its SSE stream.

Chat and text completions differ only in how a choice is shaped (``Shape``).
The request is admitted before its prompt is tokenized; a client that goes
away has its request cancelled (streaming: starlette cancels the generator;
non-streaming: a watcher on the connection), and the place it held is freed
once the engine has ended it.  Every response carries homepd's timings in the
``homepd`` field (the final chunk, when streaming).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from homepd.core.lifecycle import Lifecycle
from homepd.core.sampling import SamplingParams
from homepd.errors import HomepdError
from homepd.measure.trace.traffic import Route
from homepd.serve.errors import UNAVAILABLE, APIError, from_homepd_error, unavailable
from homepd.serve.middleware import cut
from homepd.serve.schemas import ChatCompletionRequest, CompletionRequest

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI samples at when a request does not say
MESSAGE_OVERHEAD_BYTES = 16       # counted per message toward --max-prompt-bytes: about ChatML's markup


@dataclass(frozen=True)
class Shape:
    """Where chat and text completions differ."""
    id_prefix: str
    object: str
    chunk_object: str
    is_chat: bool

    def choice(self, text: str | None, finish_reason: str | None, *, is_chunk: bool) -> dict:
        out: dict = {"index": 0}
        if not self.is_chat:
            out["text"] = text or ""
        elif is_chunk:
            out["delta"] = {} if text is None else {"content": text}
        else:
            out["message"] = {"role": "assistant", "content": text or ""}
        out.update(logprobs=None, finish_reason=finish_reason)
        return out


CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", True)
TEXT = Shape("cmpl-", "text_completion", "text_completion", False)


async def complete(service, request: Request, body: ChatCompletionRequest | CompletionRequest, request_class: str):
    """Run ``body`` on the service's engine: a JSON response, or an SSE stream when ``body.stream``."""
    shape = CHAT if isinstance(body, ChatCompletionRequest) else TEXT
    if body.model not in service.served_model_ids:
        raise APIError(404, f"model {cut(body.model)!r} is not served here; GET /v1/models lists "
                            f"{', '.join(service.served_model_ids)}", "not_found_error", "model_not_found", "model")
    params = sampling_params(body, service.settings)
    prompt, messages = (None, body.chat_messages()) if shape.is_chat else (body.prompt_text(), None)
    if messages and len(messages) > service.settings.max_messages:
        raise APIError(413, f"{len(messages)} messages; this service takes at most {service.settings.max_messages} "
                            "(--max-messages)", code="too_many_messages", param="messages")
    # why: each message costs its template's markup too, so empty messages are not free
    n_bytes = sum(len(m["content"].encode()) + MESSAGE_OVERHEAD_BYTES for m in messages) if messages \
        else len(prompt.encode())
    if n_bytes > service.settings.max_prompt_bytes:
        raise APIError(413, f"the prompt is {n_bytes} bytes; this service takes at most "
                            f"{service.settings.max_prompt_bytes} (--max-prompt-bytes)", code="prompt_too_large",
                       param="messages" if messages else "prompt")
    rid = shape.id_prefix + uuid.uuid4().hex
    await service.until_admitting()  # why: a switch of configuration under way (homepd.serve.switch) holds it
    service.admit(rid, request_class)
    try:
        stream = await service.engine.submit(prompt, messages=messages, params=params, request_id=rid,
                                             request_class=request_class)
    except HomepdError as exc:
        service.finished(rid, None, request_class)
        error = from_homepd_error(exc)
        if error.status < 500:
            service.metrics.rejected.labels(error.code or error.type).inc()
        raise error from None
    service.note_arrival(stream, Route.CHAT if shape.is_chat else Route.COMPLETIONS, params.max_tokens, prompt,
                         messages)
    created = int(time.time())
    model = body.model
    if body.stream:
        usage_mode = "continuous" if body.continuous_usage else "final" if body.include_usage else None
        return EngineEventStream(service, stream, request_class,
                                 _sse(service, shape, stream, model, created, usage_mode))
    return await _respond(service, request, shape, stream, model, created, request_class)


def sampling_params(body, settings) -> SamplingParams:
    """The engine's sampling parameters for ``body`` (OpenAI's defaults where it is silent)."""
    max_tokens = body.asked_max_tokens()
    if max_tokens is not None and max_tokens > settings.max_tokens:
        raise APIError(400, f"max_tokens={max_tokens} exceeds this service's limit of {settings.max_tokens} "
                            "(--max-tokens)", code="invalid_value", param="max_tokens")
    params = SamplingParams(
        max_tokens=max_tokens or settings.max_tokens,
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else float(body.temperature),
        top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else float(body.top_p), seed=body.seed,
        stop=body.stop_strings(), ignore_eos=body.ignore_eos)
    try:
        return params.validated()
    except HomepdError as exc:
        raise from_homepd_error(exc) from None


async def _respond(service, request: Request, shape: Shape, stream, model: str, created: int, request_class: str):
    """Collect the whole answer; cancel it if the client goes away first."""
    collecting = asyncio.ensure_future(stream.collect())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():  # the client is gone: free its sequence now
            service.engine.cancel(stream.request_id)
        events, text = await collecting
    finally:
        watcher.cancel()
        service.finished(stream.request_id, stream.lifecycle, request_class)
    last = events[-1]
    if last.kind == "error":
        raise unavailable(f"the request failed: {last.error}", "worker_failed")
    if last.finish_reason == "cancelled":
        raise unavailable("the request was aborted: homepd is shutting down", "aborted")
    lc = stream.lifecycle
    return JSONResponse({
        "id": stream.request_id, "object": shape.object, "created": created, "model": model,
        "choices": [shape.choice(text, last.finish_reason, is_chunk=False)],
        "usage": usage(lc), "homepd": timings(lc, service.config.mode)})


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(service, shape: Shape, stream, model: str, created: int, usage_mode: str | None):
    """The SSE body: a chunk per piece of text, a final chunk with the finish reason and timings, the usage
    chunk when asked (``stream_options.include_usage``), then ``data: [DONE]``.  ``usage_mode``: None, "final"
    (``usage`` null on every chunk but the last) or "continuous" (the usage so far on every chunk)."""
    n_out = 0

    def chunk(choices: list, **extra) -> bytes:
        so_far = usage(stream.lifecycle, n_out)
        body = {"id": stream.request_id, "object": shape.chunk_object, "created": created, "model": model,
                "choices": choices, **({"usage": so_far if usage_mode == "continuous" else None} if usage_mode else {}),
                **extra}
        return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))

    if shape.is_chat:
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for event in stream:
        n_out += event.kind == "token"
        if event.text:
            yield chunk([shape.choice(event.text, None, is_chunk=True)])
        if event.kind == "done" and event.finish_reason != "cancelled":
            lc = stream.lifecycle
            yield chunk([shape.choice(None if shape.is_chat else "", event.finish_reason, is_chunk=True)],
                        homepd=timings(lc, service.config.mode))
            if usage_mode:
                yield chunk([], usage=usage(lc))
        elif event.kind != "token":
            why = event.error or "aborted: homepd is shutting down"
            yield format_sse_event(data_str=json.dumps(APIError(
                503, f"the request failed: {why}", UNAVAILABLE, "worker_failed" if event.error else "aborted"
            ).body()))
    yield format_sse_event(data_str="[DONE]")


class EngineEventStream(EventSourceResponse):
    """The SSE response of one engine request, which frees the request however the response ends.

    # why: cleanup lives here, not in the body generator: a client that leaves before the first byte
    # gets its response task cancelled before the generator ever starts, and a generator that never
    # started runs no ``finally``.
    """

    def __init__(self, service, stream, request_class: str, body):
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.service, self.stream, self.request_class = service, stream, request_class

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.service.engine.is_running(self.stream.request_id):  # the client left: cancel, free it later
                self.service.engine.cancel(self.stream.request_id)
                self.service.spawn_finish(self.stream, self.request_class)
            else:
                self.service.finished(self.stream.request_id, self.stream.lifecycle, self.request_class)


def usage(lc: Lifecycle, n_out: int | None = None) -> dict:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens``: the prompt tokens served from a reused
    prefix (OpenAI's and llama-server's field; 0 when nothing was reused).  ``n_out``: the completion tokens so
    far (streamed usage), else every token the request produced."""
    n_out = len(lc.token_times_s) if n_out is None else n_out
    return {"prompt_tokens": lc.n_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": lc.n_prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": lc.n_cached_tokens}}


def timings(lc: Lifecycle, mode: str) -> dict:
    """The ``homepd`` object: the mode that served the request and its ``RequestTimings`` (one shape with
    ``Lifecycle.to_dict`` and the app)."""
    return {"mode": mode, **lc.timings().to_dict()}
