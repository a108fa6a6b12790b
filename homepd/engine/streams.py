"""What a request's caller receives: a stream of events with monotonic timestamps."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from enum import Enum

from homepd.core.lifecycle import Lifecycle
from homepd.core.protocol import SubmitRequest
from homepd.core.records import FinishReason
from homepd.core.sampling import TokenLogprob
from homepd.chat.textstream import TextStream
from homepd.engine.recovery import HeldRequest


class EventKind(str, Enum):
    TOKEN = "token"
    DONE = "done"      # the request ended (its finish_reason says how)
    ERROR = "error"    # it failed (always the last event)


@dataclass(frozen=True)
class Event:
    """One streamed event: a token, the end of the request, or an error (always last)."""
    kind: EventKind
    request_id: str
    t_s: float
    token_id: int | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None


class RequestStream:
    """Async iterator over a request's events; ends after its 'done' or 'error' event."""

    def __init__(self, request_id: str, lifecycle: Lifecycle, prompt_ids: tuple[int, ...] = (),
                 params=None):
        self.request_id = request_id
        self.lifecycle = lifecycle
        self.prompt_ids = prompt_ids   # kept to resume the request by recompute
        self.params = params
        self.token_ids: list[int] = []  # every token streamed so far
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        event = await self.queue.get()
        self._ended = event.kind is not EventKind.TOKEN
        return event

    async def collect(self) -> tuple[list[Event], str]:
        """Drain the stream: (all events, concatenated text)."""
        events = [e async for e in self]
        return events, "".join(e.text for e in events)

    # when its worker died ------------------------------------------------------------
    def held(self, is_cancelling: bool, in_intact_extent: bool) -> HeldRequest:
        """The request as recovery sees it."""
        return HeldRequest(request_id=self.request_id, n_prompt=len(self.prompt_ids), n_output=len(self.token_ids),
                           max_tokens=self.params.max_tokens, n_resumes=self.lifecycle.n_resumes,
                           is_cancelling=is_cancelling, in_intact_extent=in_intact_extent)

    def note_resume(self, how: str) -> None:
        self.lifecycle.n_resumes += 1
        self.lifecycle.resumed_by.append(how)

    def resubmission(self, token_to_piece, deadline_s: float) -> SubmitRequest:
        """The request again, its output so far appended to the prompt, with the text stream rebuilt
        (``token_to_piece``: the tokenizer's); its prefill starts over."""
        text = TextStream(self.params.stop)
        for token in self.token_ids:
            text.feed(token_to_piece(token))
        params = replace(self.params, max_tokens=self.params.max_tokens - len(self.token_ids))
        self.lifecycle.n_prefilled = 0
        return SubmitRequest(self.request_id, self.prompt_ids + tuple(self.token_ids), params, stream=text,
                             request_class=self.lifecycle.request_class, deadline_s=deadline_s,
                             history_ids=tuple(self.token_ids))
