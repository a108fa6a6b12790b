"""The client of ``homepd bench slo``: one OpenAI-compatible server, streamed, timed by the client's clock.

``HttpTarget`` looks like an engine to ``homepd.measure.replay.replay``: ``submit(prompt | messages, params,
request_class)`` returns a stream whose ``collect()`` sends the request (``/v1/chat/completions`` for chat
messages, ``/v1/completions`` for a raw prompt; ``stream: true``, ``stream_options.include_usage``) and
fills a ``Lifecycle`` on ``time.monotonic()``: sent (arrived and admitted), every streamed chunk that
carries text (the first is the TTFT, the rest the gaps; reasoning counts, and the first chunk of the answer
itself, content or a tool call, is the time to the first answer token), the end.  A chunk counts as one token: servers
stream one token per chunk (llama-server, vLLM, SGLang, homepd), and a server that batches tokens into
chunks is judged by the gaps the user sees.  A non-200 answer or a broken stream is a failed request with
the server's words in ``error``, never an exception out of the replay.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

from homepd.core.terms import RequestClass
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.core.records import FinishReason
from homepd.core.sampling import SamplingParams
from homepd.errors import ConfigError
from homepd.measure.trace.model import tag_user_turns

CLASS_HEADER = "X-Homepd-Class"  # homepd's class header; other servers ignore it
ERROR_CHARS = 300


@dataclass
class ChatStream:
    """One request to send; ``collect()`` streams it and returns its ``lifecycle`` (filled in place)."""
    target: "HttpTarget"
    path: str
    body: dict
    lifecycle: Lifecycle

    async def collect(self) -> Lifecycle:
        await self.target.stream(self.path, self.body, self.lifecycle)
        return self.lifecycle


@dataclass
class HttpTarget:
    """An OpenAI-compatible server at ``base_url`` (``http://host:port``; a trailing ``/v1`` is dropped)."""
    base_url: str
    model: str = ""
    api_key: str | None = None
    # "[TAG request N] " before every prompt's user text when set (N counts this target's requests): every
    # prompt then differs from its first token, so no server serves one from an earlier probe's cached KV
    unique_tag: str | None = None
    timeout_s: float = 600.0
    clock: object | None = None       # the replay's Clock (its now()); None: time.monotonic
    transport: httpx.AsyncBaseTransport | None = None  # None: the network (tests pass an in-process server)
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # sent with every request
    _client: httpx.AsyncClient | None = field(default=None, repr=False)
    _ids: itertools.count = field(default_factory=itertools.count, repr=False)

    def __post_init__(self):
        url = self.base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--url takes http://HOST:PORT or https://..., got {self.base_url!r}")

    async def __aenter__(self) -> "HttpTarget":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # why no connection limit: an open loop must not queue requests in the client (that would hide the
        # server's queue from the TTFT)
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                         timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                         transport=self.transport)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()
        self._client = None

    async def served_model(self) -> str:
        """The first model id of ``/v1/models`` (``ConfigError`` when the server gives none)."""
        try:
            r = await self._client.get("/v1/models", timeout=10.0)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ConfigError(f"{self.base_url}/v1/models gave no model id ({type(exc).__name__}: {exc}); "
                              "pass --model-name") from None

    async def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     params: SamplingParams | None = None, request_class=None) -> ChatStream:
        """A stream for ``replay``: nothing is sent until ``collect()``."""
        params = params or SamplingParams()
        klass = RequestClass(request_class or RequestClass.INTERACTIVE)
        index = next(self._ids)
        tag = f"[{self.unique_tag} request {index}] " if self.unique_tag else ""
        common = {"model": self.model, "max_tokens": params.max_tokens, "stream": True, **self.sampling,
                  "stream_options": {"include_usage": True}}
        if params.ignore_eos:
            common["ignore_eos"] = True  # why: vLLM, SGLang, llama-server and homepd all read this extension
        if messages is not None:
            if tag:
                messages = tag_user_turns(messages, tag)
            path, body = "/v1/chat/completions", {**common, "messages": messages}
        else:
            path, body = "/v1/completions", {**common, "prompt": tag + (prompt or "")}
        lc = Lifecycle(request_id=f"bench-{index}", arrived_s=self.now(), request_class=klass)
        return ChatStream(self, path, body, lc)

    def now(self) -> float:
        return self.clock.now() if self.clock is not None else time.monotonic()

    async def stream(self, path: str, body: dict, lc: Lifecycle) -> None:
        """Send one request and time its chunks into ``lc`` (see the module docstring)."""
        lc.arrived_s = self.now()
        lc.advance(RequestState.PREFILLING, lc.arrived_s)
        headers = {CLASS_HEADER: lc.request_class.value}
        try:
            async with self._client.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    return _fail(lc, f"HTTP {r.status_code}: {text[:ERROR_CHARS]}", self.now())
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    _chunk(lc, json.loads(data), self.now())
        except (httpx.HTTPError, ValueError) as exc:
            return _fail(lc, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS], self.now())
        if lc.first_token_s is None:
            return _fail(lc, "the stream ended without any text", self.now())
        lc.advance(RequestState.FINISHED, self.now())


def _chunk(lc: Lifecycle, chunk: dict, now_s: float) -> None:
    """One streamed ``data:`` object into the lifecycle (text -> a token at ``now_s``; usage; finish)."""
    if not isinstance(chunk, dict):
        raise ValueError(f"a streamed chunk is not a JSON object: {str(chunk)[:80]}")
    if isinstance(chunk.get("error"), (dict, str)):
        raise ValueError(f"the server reported an error mid-stream: {json.dumps(chunk['error'])[:200]}")
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        lc.n_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            lc.n_cached_tokens = details["cached_tokens"]
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        calls = delta.get("tool_calls")
        if text or thought or calls:
            if lc.state is RequestState.PREFILLING:
                lc.advance(RequestState.DECODING, now_s)
            lc.add_token(now_s)
            if (text or calls) and lc.first_answer_s is None:  # the answer itself, past the reasoning
                lc.first_answer_s = now_s
        reason = choice.get("finish_reason")
        if reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
            lc.finish_reason = FinishReason(reason)


def _fail(lc: Lifecycle, error: str, now_s: float) -> None:
    lc.error = error
    lc.advance(RequestState.FAILED, now_s)
