"""One engine request's reply as it comes, whatever the face: the text read into content, reasoning and tool
calls (``homepd.chat.parser``), the answer collected (non-streaming: cancelled when the client leaves), the
request released however its response ends, and the figures every face reports (``usage``, ``timings``).

The OpenAI routes (``homepd.serve.generation``) and the Ollama routes (``homepd.serve.ollama``) shape these
into their own wire formats.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from homepd.chat.reply import DeltaKind
from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.core.sampling import TokenLogprob
from homepd.core.terms import RequestClass
from homepd.engine.streams import EventKind
from homepd.serve.chat import RequestPlan, arguments_json
from homepd.serve.errors import unavailable


@dataclass(frozen=True)
class Shape:
    """Where chat and text completions differ."""
    id_prefix: str
    object: str
    chunk_object: str
    is_chat: bool


CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", True)
TEXT = Shape("cmpl-", "text_completion", "text_completion", False)


@dataclass
class Reply:
    """One request's reply as it comes: events in, OpenAI pieces out (chat deltas, text, log-probabilities)."""
    service: object
    shape: Shape
    stream: object
    plan: RequestPlan
    model: str
    created: int
    ignored: list[str]
    parser: object = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: object = None       # the parser's Reply, once flushed
    engine: object = None      # the engine of the model that runs it
    load_s: float = 0.0        # seconds it waited for its model's load

    def __post_init__(self):
        self.parser = self.plan.parser()

    def feed(self, text: str, t_s: float) -> list[dict]:
        """The chat deltas (or completion texts) of ``text``; notes the first answer token's time."""
        if self.parser is None:
            if text:
                self._answered(t_s)
                self.content.append(text)
            return [{"content": text}] if text else []
        return [self._delta(d, t_s) for d in self.parser.feed(text)]

    def flush(self, t_s: float) -> list[dict]:
        """What the parser still held at the end (a cut call becomes content)."""
        if self.parser is None:
            return []
        deltas = [self._delta(d, t_s) for d in self.parser.flush()]
        self.final = self.parser.finish()
        return deltas

    def _delta(self, d, t_s: float) -> dict:
        if d.kind is DeltaKind.REASONING:
            self.reasoning.append(d.text)
            return {"reasoning_content": d.text}
        self._answered(t_s)
        if d.kind is DeltaKind.CONTENT:
            self.content.append(d.text)
            return {"content": d.text}
        if d.kind is DeltaKind.TOOL_CALL_START:
            self.calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                    "function": {"name": d.name, "arguments": ""}}]}
        self.calls[d.index]["function"]["arguments"] += d.text
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}

    def _answered(self, t_s: float) -> None:
        lc = self.stream.lifecycle
        if lc.first_answer_s is None:
            lc.first_answer_s = t_s

    @property
    def tool_calls(self) -> tuple:
        """The reply's complete tool calls (a call cut short, or malformed, is content instead)."""
        return self.final.tool_calls if self.final is not None else ()

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def message(self) -> dict:
        """The whole chat message."""
        if self.final is None:
            return {"role": "assistant", "content": "".join(self.content)}
        r = self.final
        text = r.content or ""
        out: dict = {"role": "assistant", "content": None if r.tool_calls and not text.strip() else text}
        if r.reasoning:
            out["reasoning_content"] = r.reasoning
        if r.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": arguments_json(c.arguments)}}
                                 for c in r.tool_calls]
        return out

    def homepd(self) -> dict:
        mode = self.engine.config.mode if self.engine is not None else self.service.config.mode
        return {**timings(self.stream.lifecycle, mode),
                **({"ignored_fields": self.ignored} if self.ignored else {})}


async def collect(reply: "Reply", request: Request, request_class: RequestClass):
    """Collect the whole answer into ``reply`` and return its last event; cancel it if the client goes away
    first.  Raises a 503 APIError when the request failed or was aborted; frees its admission place."""
    service, stream = reply.service, reply.stream
    collecting = asyncio.ensure_future(stream.collect())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():  # the client is gone: free its sequence now
            service.models.engine_of(stream.request_id).cancel(stream.request_id)
        events, _ = await collecting
    finally:
        watcher.cancel()
    try:
        last = events[-1]
        if last.kind is EventKind.ERROR:
            raise unavailable(f"the request failed: {last.error}", "worker_failed")
        if last.finish_reason is FinishReason.CANCELLED:
            raise unavailable("the request was aborted: homepd is shutting down", "aborted")
        for e in events:
            reply.feed(e.text, e.t_s)
            if e.logprob is not None:
                reply.logprobs.append(e.logprob)
        reply.flush(last.t_s)
    finally:
        service.finished(stream.request_id, stream.lifecycle, request_class)
    return last


def release(service, stream, request_class: RequestClass) -> None:
    """A streamed response ended (done, failed, or its client left): free the request's place, cancelling it
    first if it still runs.

    # why: a response class calls this from its ``__call__``, not its body generator: a client that leaves
    # before the first byte gets its response task cancelled before the generator ever starts, and a
    # generator that never started runs no ``finally``.
    """
    engine = service.models.engine_of(stream.request_id)
    if engine is not None and engine.is_running(stream.request_id):  # the client left: cancel, free it later
        engine.cancel(stream.request_id)
        service.spawn_finish(stream, request_class)
    else:
        service.finished(stream.request_id, stream.lifecycle, request_class)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _token_entry(piece: bytes, logprob: float) -> dict:
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    """OpenAI chat's ``choices[].logprobs``: one entry per token, with its ``top_logprobs``."""
    return {"content": [{**_token_entry(lp.piece, lp.logprob),
                         "top_logprobs": [_token_entry(p, v) for _, p, v in lp.top]} for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions ``logprobs``: tokens, their logprobs, the top ones as {token: logprob}, offsets."""
    tokens = [lp.piece.decode("utf-8", errors="replace") for lp in logprobs]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{p.decode("utf-8", errors="replace"): v for _, p, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


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
    ``Lifecycle.to_dict`` and the app; ``ttfa_s``: the time to its first answer token, past any reasoning)."""
    return {"mode": mode, **lc.timings().to_dict()}
