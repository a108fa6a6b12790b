"""What the app knows, kept in one place so that a screen shown later draws what happened meanwhile.

The app updates it from the messages its workers send; screens read it when
they are shown and when the app tells them something changed.  Plain data, no
Textual.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from homepd.chat.reply import Delta, DeltaKind, ToolCall
from homepd.tui.liveadvice import AdviceView
from homepd.tui.records import AdviseStep, AdviseView, ChartPoint, ChatStats, RequestRow, Tick

CHART_POINTS = 600      # 5 minutes at two ticks a second
RECENT_REQUESTS = 50
# what a later turn tells the model of a call it made: the tester shows calls, it does not run them
NOT_RUN = '{"error": "not run: the chat tester shows tool calls without running them"}'


@dataclass
class ChatTurn:
    """One question and its reply, kept in its three parts: the reasoning (a thinking model's), the content
    (``reply``) and the tool calls, by their index in the stream."""
    user: str
    reply: str = ""
    stats: ChatStats | None = None
    error: str | None = None
    reasoning: str = ""
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)

    @property
    def is_done(self) -> bool:
        return self.stats is not None or self.error is not None

    def add(self, delta: Delta) -> None:
        """Take one streamed piece of the reply (arguments for a call not started are dropped)."""
        if delta.kind is DeltaKind.CONTENT:
            self.reply += delta.text
        elif delta.kind is DeltaKind.REASONING:
            self.reasoning += delta.text
        elif delta.kind is DeltaKind.TOOL_CALL_START:
            self.tool_calls[delta.index] = ToolCall(delta.id or f"call_{delta.index}", delta.name or "?", "")
        elif delta.index in self.tool_calls:
            call = self.tool_calls[delta.index]
            self.tool_calls[delta.index] = replace(call, arguments=call.arguments + delta.text)

    def messages(self) -> list[dict]:
        """The turn as chat history: the question, the answer (its calls with it, each followed by a tool
        message saying it was not run; the reasoning is not sent back)."""
        answer: dict = {"role": "assistant", "content": self.reply}
        calls = list(self.tool_calls.values())
        if calls:
            answer["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return [{"role": "user", "content": self.user}, answer,
                *({"role": "tool", "tool_call_id": c.id, "content": NOT_RUN} for c in calls)]


@dataclass
class AppState:
    description: str = "starting…"
    is_ready: bool = False
    error: str | None = None
    can_switch_mode: bool = False
    switching: bool = False
    pull: tuple[str, int, int | None] | None = None        # (label, done bytes, total bytes)
    tick: Tick | None = None
    points: deque[ChartPoint] = field(default_factory=lambda: deque(maxlen=CHART_POINTS))
    requests: deque[RequestRow] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    turns: list[ChatTurn] = field(default_factory=list)
    offer_tool: bool = False                                  # chat requests offer the demo tool (ctrl+o)
    n_background: int = 0                                     # background prompts in flight
    last_background: ChatStats | None = None
    advise_running: bool = False
    advise_step: AdviseStep | None = None
    advise_candidates: dict[str, int] = field(default_factory=dict)   # candidate -> runs done
    advise_view: AdviseView | None = None
    advise_view_stored: bool = False                          # advise_view is the latest stored run, not this app's
    advise_error: str | None = None
    advice: AdviceView | None = None                         # live advice standing now (None: none)

    @property
    def mode(self) -> str | None:
        arch = self.tick.architecture if self.tick else None
        return arch.mode if arch else None

    def add_tick(self, tick: Tick) -> None:
        self.tick = tick
        self.points.append(tick.point)
        self.requests.extend(tick.requests)

    def add_advise_step(self, step: AdviseStep) -> None:
        """The campaign's latest step; its candidate's count of steps done goes up where the campaign's did (a
        twin's steps end "calibrated", "the twin done", "checked at ...": not every one in " done")."""
        before = self.advise_step.done if self.advise_step is not None else 0
        if self.advise_step is None or step.done >= self.advise_step.done:
            self.advise_step = step
        if step.candidate:
            done = self.advise_candidates.get(step.candidate, 0)
            self.advise_candidates[step.candidate] = done + (1 if step.done > before else 0)

    def chat_messages(self) -> list[dict]:
        """The conversation so far as chat messages (turns that failed are left out)."""
        return [m for turn in self.turns if turn.error is None and turn.is_done for m in turn.messages()]
