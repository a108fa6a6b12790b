"""What a request's caller receives: a stream of events with monotonic timestamps."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason


@dataclass(frozen=True)
class Event:
    """One streamed event: a token, the end of the request, or an error (always last)."""
    kind: str  # "token" | "done" | "error"
    request_id: str
    t_s: float
    token_id: int | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None


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
        self._ended = event.kind != "token"
        return event

    async def collect(self) -> tuple[list[Event], str]:
        """Drain the stream: (all events, concatenated text)."""
        events = [e async for e in self]
        return events, "".join(e.text for e in events)
