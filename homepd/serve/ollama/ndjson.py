"""An engine request's reply in Ollama's shape: NDJSON chunks (one whole JSON object a line), or one object.

A chat's chunk carries ``message`` (``content``, and ``thinking`` for reasoning), a generate's ``response``
(and ``thinking``); tool calls come whole, with ``arguments`` as an object, in a chunk of their own before the
last one.  The last chunk has ``done: true``, ``done_reason`` (``stop`` or ``length``; ``load`` and ``unload``
for a request without messages) and the counts and durations in nanoseconds: ``total_duration``,
``load_duration``, ``prompt_eval_count``, ``prompt_eval_duration`` (arrival to first token, less the queue),
``eval_count``, ``eval_duration`` (first token to last).  An error after the stream began is one more line,
``{"error": "..."}``.  The text is read by the same ``Reply`` as the OpenAI routes' (``homepd.serve.reply``).
"""
from __future__ import annotations

import datetime as dt
import json

from fastapi.responses import StreamingResponse

from homepd.core.records import FinishReason
from homepd.core.terms import RequestClass
from homepd.engine.streams import EventKind
from homepd.serve.reply import Reply, release

NDJSON = "application/x-ndjson"
NS = 1_000_000_000


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def chunk(is_chat: bool, model: str, text: str = "", thinking: str | None = None,
          tool_calls: list | None = None) -> dict:
    """One chunk (``done: false``) of a chat (``message``) or a generate (``response``)."""
    if is_chat:
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"model": model, "created_at": created_at(), "message": message, "done": False}
    out = {"model": model, "created_at": created_at(), "response": text, "done": False}
    if thinking:
        out["thinking"] = thinking
    return out


def done(is_chat: bool, model: str, reason: str, **figures) -> dict:
    """The last chunk: ``done_reason`` and the figures (``durations``), or a load/unload's answer."""
    return {**chunk(is_chat, model), "done": True, "done_reason": reason, **figures}


def durations(reply: Reply, load_s: float = 0.0) -> dict:
    """Ollama's counts and nanosecond durations of a finished request."""
    t = reply.stream.lifecycle.timings()
    ttft_s, e2e_s, queue_s = t.ttft_s or 0.0, t.e2e_s or 0.0, t.queue_wait_s or 0.0
    return {"total_duration": int((e2e_s + load_s) * NS), "load_duration": int(load_s * NS),
            "prompt_eval_count": t.n_prompt_tokens, "prompt_eval_duration": int(max(0.0, ttft_s - queue_s) * NS),
            "eval_count": t.n_output_tokens, "eval_duration": int(max(0.0, e2e_s - ttft_s) * NS)}


def tool_calls(reply: Reply) -> list[dict]:
    """The reply's tool calls as Ollama sends them: ``arguments`` an object."""
    out = []
    for i, call in enumerate(reply.tool_calls):
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = {}
        out.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                "arguments": arguments if isinstance(arguments, dict) else {}}})
    return out


def done_reason(reply: Reply, finish_reason: str) -> str:
    return "length" if reply.finish_reason(finish_reason) == "length" else "stop"


def whole(reply: Reply, finish_reason: str, is_chat: bool, load_s: float) -> dict:
    """The non-streamed answer: one object with the whole text, the calls, and the last chunk's fields."""
    final = reply.final
    text = (final.content or "") if final is not None else "".join(reply.content)
    thinking = final.reasoning if final is not None else None
    calls = tool_calls(reply) if is_chat else None
    body = chunk(is_chat, reply.model, text, thinking, calls)
    return {**body, "done": True, "done_reason": done_reason(reply, finish_reason), **durations(reply, load_s)}


async def lines(reply: Reply, is_chat: bool, load_s: float):
    """The NDJSON body of a streamed reply."""
    def line(obj: dict) -> bytes:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode()

    async for event in reply.stream:
        deltas = reply.feed(event.text, event.t_s)
        ended = event.kind is EventKind.DONE and event.finish_reason is not FinishReason.CANCELLED
        if ended:
            deltas += reply.flush(event.t_s)
        for delta in deltas:
            if delta.get("content"):
                yield line(chunk(is_chat, reply.model, delta["content"]))
            elif delta.get("reasoning_content"):
                yield line(chunk(is_chat, reply.model, thinking=delta["reasoning_content"]))
        if ended:
            if is_chat and reply.tool_calls:
                yield line(chunk(is_chat, reply.model, tool_calls=tool_calls(reply)))
            yield line(done(is_chat, reply.model, done_reason(reply, event.finish_reason),
                            **durations(reply, load_s)))
        elif event.kind is EventKind.ERROR:
            yield line({"error": f"the request failed: {event.error or 'aborted: homepd is shutting down'}"})
        elif event.kind is EventKind.DONE:
            yield line({"error": "the request failed: aborted: homepd is shutting down"})


class NdjsonStream(StreamingResponse):
    """The NDJSON response of one engine request, which frees the request however the response ends."""

    def __init__(self, service, reply: Reply, request_class: RequestClass, body):
        super().__init__(body, media_type=NDJSON, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.service, self.stream, self.request_class = service, reply.stream, request_class

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release(self.service, self.stream, self.request_class)
