"""The chat tester: a conversation streamed from the engine, each reply in its parts (reasoning, answer, tool
calls) with its TTFT, TPOT, architecture and KV handoff; ctrl+b fires a long background prompt, ctrl+t switches
colocated / disaggregated, ctrl+o offers a demo tool (get_current_time) with the requests, ctrl+n picks the chat
model among those the source serves (listed by their Ollama names with their state)."""
from __future__ import annotations

import json

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from homepd.chat.reply import ToolCall
from homepd.tui.records import ChatStats
from homepd.tui.screens.base import StateScreen
from homepd.tui.sources.chatrequest import DEMO_TOOL
from homepd.tui.state import AppState, ChatTurn
from homepd.tui.widgets.text import num, size

INDENT = " " * 5          # under the text after "you  " / "llm  "
REASONING_LINES = 6       # a longer reasoning shows its last lines


def stats_text(stats: ChatStats) -> Text:
    """The line under a reply."""
    ended = f" ({stats.finish_reason})" if stats.finish_reason not in (None, "stop") else ""
    ttft = f"TTFT {num(stats.ttft_ms)} ms"
    if stats.n_cached_tokens is not None:  # the prefix reused for it: what the TTFT did not have to compute
        ttft += f" ({stats.n_cached_tokens}/{stats.n_prompt_tokens or '?'} prompt tok cached)"
    parts = [ttft, f"TPOT {num(stats.tpot_ms, '.1f')} ms", stats.mode,
             f"{stats.n_output_tokens} tok{ended}"]
    if stats.kv_bytes is not None:
        parts.append(f"KV {size(stats.kv_bytes)}/{num(stats.kv_transfer_ms, '.1f')} ms")
    text = Text(" · ".join(parts), style="cyan")
    if stats.error:
        text.append(f"  error: {stats.error}", style="red")
    return text


def call_text(call: ToolCall) -> str:
    """A tool call as one line: its name and its arguments (spaced out once they are complete JSON)."""
    try:
        arguments = json.dumps(json.loads(call.arguments), ensure_ascii=False)
    except ValueError:
        arguments = call.arguments  # still streaming, or not JSON: as the model wrote it
    return f"→ {call.name}({arguments})"


def turn_text(turn: ChatTurn) -> Text:
    """A question and its reply: the reasoning under a "thinking" label (its last lines), the answer, each tool
    call, then the figures."""
    text = Text.assemble(("you  ", "bold"), turn.user, "\n", ("llm  ", "bold green"))
    parts = 0
    if turn.reasoning:
        lines = turn.reasoning.splitlines()
        text.append("thinking", style="dim bold")
        if len(lines) > REASONING_LINES:
            text.append(f" (last {REASONING_LINES} of {len(lines)} lines)", style="dim")
        for line in lines[-REASONING_LINES:]:
            text.append(f"\n{INDENT}")
            text.append(line, style="dim italic")
        parts += 1
    if turn.reply:
        text.append(f"\n{INDENT}" if parts else "")
        text.append(turn.reply)
        parts += 1
    for call in turn.tool_calls.values():
        text.append(f"\n{INDENT}" if parts else "")
        text.append(call_text(call), style="bold yellow")
        parts += 1
    if not parts and not turn.is_done:
        text.append("…")
    if turn.stats is not None:
        text.append(f"\n{INDENT}")
        text.append_text(stats_text(turn.stats))
    if turn.error:
        text.append(f"\n{INDENT}error: {turn.error}", style="red")
    return text


class ChatScreen(StateScreen):
    BINDINGS = [
        Binding("ctrl+b", "app.background", "long prompt", priority=True),
        Binding("ctrl+t", "app.switch_mode", "switch arch", priority=True),
        Binding("ctrl+o", "app.toggle_tool", "offer tool", priority=True),
        Binding("ctrl+n", "app.next_model", "next model", priority=True),
        Binding("escape", "leave_input", "keys", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="chat-log")
        yield Static(id="chat-status")
        yield Input(placeholder="type a message, enter to send (esc: keys)", id="chat-input")
        yield Footer()

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.query_one(Input).focus()  # coming back to the chat means typing

    def action_leave_input(self) -> None:
        self.set_focus(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if text:
            event.input.value = ""
            self.app.send_chat(text)

    def show_state(self, state: AppState, what: str) -> None:
        if what in ("chat", "all"):
            log = self.query_one("#chat-log", VerticalScroll)
            shown = list(log.query(Static))
            for i, turn in enumerate(state.turns):
                if i < len(shown):
                    shown[i].update(turn_text(turn))
                else:
                    log.mount(Static(turn_text(turn), classes="turn"))
            log.scroll_end(animate=False)
        if what in ("chat", "tick", "source", "all"):
            self.query_one("#chat-status", Static).update(self._status(state))

    def _status(self, state: AppState) -> Text:
        mode = "switching…" if state.switching else (state.mode or "no engine")
        parts = [f"architecture: {mode}"]
        if state.n_background:
            parts.append(f"{state.n_background} background prompt(s) prefilling")
        elif state.last_background is not None:
            b = state.last_background
            parts.append(f"last background: TTFT {num(b.ttft_ms)} ms, {b.n_prompt_tokens or '?'} prompt tok")
        if not state.can_switch_mode:
            parts.append("attached: the service's architecture is fixed")
        if state.offer_tool:
            parts.append(f"offering the {DEMO_TOOL.name} tool")
        text = Text(" · ".join(parts), style="dim")
        models = state.tick.models if state.tick else ()
        if models:
            chat = [m.name for m in models if m.role == "chat"]
            talking = self.app.source.chat_model or (chat[0] if chat else "?")
            text.append(f"\nmodels (ctrl+n picks the chat model): talking to {talking} · ", style="dim")
            text.append(" · ".join(f"{m.name} {m.role}, {m.state}" for m in models), style="dim")
        return text
