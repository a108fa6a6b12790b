"""A chat reply in its three parts (reasoning, content, tool calls): the embedded source parsing an engine's
text with the model's chat format, the request it builds with the demo tool, and how a turn is drawn."""
from __future__ import annotations

import pytest

from homepd.config import EngineConfig
from homepd.chat.format import ToolFormat, detect
from homepd.chat.reply import Delta, DeltaKind, ToolCall
from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.engine.streams import Event, EventKind
from homepd.tui.jobs import coalesce
from homepd.tui.records import ChatStats
from homepd.tui.screens.chat import REASONING_LINES, turn_text
from homepd.tui.sources.chatrequest import DEMO_TOOL, engine_chat
from homepd.tui.sources.embedded import EmbeddedSource
from homepd.tui.sources.loop import LoopThread
from homepd.tui.state import NOT_RUN, AppState, ChatTurn

pytestmark = pytest.mark.timeout(30)

# a small thinking template, after Qwen3's: ChatML, earlier reasoning rendered between the think markers
THINKING = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same with Hermes tool calls: the template lists the tools and shows calls as <tool_call>
HERMES = THINKING.replace(
    "{% for message in messages %}",
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}")


class StubStream:
    """An engine's event stream made of given texts, then its end."""

    def __init__(self, texts: list[str]):
        self.lifecycle = Lifecycle("req-1", 0.0)
        self._events = [Event(EventKind.TOKEN, "req-1", 0.0, token_id=k, text=t) for k, t in enumerate(texts)]
        self._events.append(Event(EventKind.DONE, "req-1", 0.0, finish_reason=FinishReason.STOP))

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)


class StubEngine:
    """What the embedded source reads of an engine: its config, its chat format and ``submit``."""

    def __init__(self, template: str | None, texts: list[str]):
        if template is not None:
            self.chat_format = detect(template)
        self.config = EngineConfig(backend="fake")
        self.texts, self.submitted = texts, []

    async def submit(self, *, messages, params, **chat):
        self.submitted.append((messages, params, chat.get("chat")))
        return StubStream(self.texts)


def chat_on(engine: StubEngine, messages: list[dict], offer_tool: bool = False) -> tuple[ChatTurn, ChatStats]:
    """One chat turn through an embedded source whose engine is ``engine``; the turn as the app keeps it."""
    source = EmbeddedSource(EngineConfig(backend="fake"))
    source.engine, source._loop = engine, LoopThread()  # why: started here, not by start()
    turn = ChatTurn(messages[-1]["content"])
    try:
        stats = source.chat(messages, turn.add, max_tokens=32, offer_tool=offer_tool)
    finally:
        source._loop.close()
    return turn, stats


def test_the_embedded_source_splits_a_thinking_model_s_reasoning_from_its_answer():
    fmt = detect(THINKING)
    assert fmt.think is not None and not fmt.opens_thinking and fmt.tools is ToolFormat.GENERIC
    # the markers arrive split across tokens, as a tokenizer cuts them
    engine = StubEngine(THINKING, ["<th", "ink>\nThe user", " greets me.\nI greet", " back.</th", "ink>\n\n",
                                   "Hello", " there!"])
    turn, stats = chat_on(engine, [{"role": "user", "content": "hi"}])
    assert turn.reasoning == "The user greets me.\nI greet back."
    assert turn.reply == "Hello there!" and turn.tool_calls == {}
    assert stats.finish_reason == "stop" and stats.error is None
    messages, params, extras = engine.submitted[0]
    assert messages == [{"role": "user", "content": "hi"}] and params.grammar is None and extras.tools is None
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 32)  # as chat clients sample


def test_an_engine_without_a_chat_format_streams_plain_text():
    engine = StubEngine(None, ["<think>a</think>", "b"])
    turn, _ = chat_on(engine, [{"role": "user", "content": "hi"}])
    assert (turn.reasoning, turn.reply) == ("", "<think>a</think>b")
    assert engine.submitted[0][2] is None   # submitted without chat extras, as an older engine takes it


def test_offering_the_tool_gives_the_template_its_tools_and_reads_the_call_back():
    engine = StubEngine(HERMES, ["<think>They want the time.</think>", "<tool_call>\n{\"name\": ",
                                 "\"get_current_time\", \"arguments\": {\"timezone\": ", "\"UTC\"}}\n</tool_call>"])
    turn, _ = chat_on(engine, [{"role": "user", "content": "what time is it?"}], offer_tool=True)
    assert turn.reasoning == "They want the time." and turn.reply == ""
    [call] = turn.tool_calls.values()
    assert (call.name, call.arguments) == ("get_current_time", '{"timezone": "UTC"}')
    extras = engine.submitted[0][2]
    assert extras.tools == [DEMO_TOOL.to_openai()]


def test_a_template_without_a_tool_format_is_told_of_the_tool_in_a_system_message():
    request = engine_chat(detect(THINKING), [{"role": "user", "content": "hi"}], offer_tool=True)
    assert request.chat.tools is None and request.messages[0]["role"] == "system"
    assert "get_current_time" in request.messages[0]["content"]
    parser = request.parser()   # the reply is the generic JSON envelope
    parser.feed('{"tool_calls": [{"name": "get_current_time", "arguments": {"timezone": "UTC"}}]}')
    assert [c.name for c in parser.finish().tool_calls] == ["get_current_time"]


def test_the_demo_tool_s_grammar_keeps_a_call_to_its_schema():
    grammar = engine_chat(detect(HERMES), [{"role": "user", "content": "hi"}], offer_tool=True).grammar
    assert grammar is not None and grammar.is_lazy and "get_current_time" in grammar.gbnf


def test_a_later_turn_resends_a_call_with_a_tool_message_saying_it_was_not_run():
    turn = ChatTurn("what time is it?", reasoning="hmm", stats=ChatStats("colocated", 1.0, 1.0, 9, 3, "stop"))
    turn.add(Delta(DeltaKind.TOOL_CALL_START, index=0, id="call_1", name="get_current_time"))
    turn.add(Delta(DeltaKind.TOOL_CALL_ARGS, '{"timezone": "UTC"}', index=0))
    assert AppState(turns=[turn]).chat_messages() == [
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_current_time", "arguments": '{"timezone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": NOT_RUN}]


def test_pieces_of_one_part_are_joined_and_the_parts_keep_their_order():
    start, args = DeltaKind.TOOL_CALL_START, DeltaKind.TOOL_CALL_ARGS
    pieces = [Delta(DeltaKind.REASONING, "a"), Delta(DeltaKind.REASONING, "b"), Delta(DeltaKind.CONTENT, "c"),
              Delta(start, index=0, id="x", name="f"), Delta(args, "{", index=0), Delta(args, "}", index=0),
              Delta(start, index=1, id="y", name="g"), Delta(args, "{}", index=1)]
    assert coalesce(pieces) == (Delta(DeltaKind.REASONING, "ab"), Delta(DeltaKind.CONTENT, "c"), pieces[3],
                                Delta(args, "{}", index=0), pieces[6], pieces[7])


def test_a_turn_draws_its_reasoning_dim_its_answer_and_each_call_on_a_line():
    turn = ChatTurn("q", "the answer", reasoning="\n".join(f"step {k}" for k in range(10)),
                    tool_calls={0: ToolCall("c", "get_current_time", '{"timezone":"UTC"}')})
    text = turn_text(turn)
    lines = text.plain.splitlines()
    assert lines[1] == f"llm  thinking (last {REASONING_LINES} of 10 lines)"
    assert lines[2:2 + REASONING_LINES] == [f"     step {k}" for k in range(10 - REASONING_LINES, 10)]
    assert lines[-2:] == ["     the answer", '     → get_current_time({"timezone": "UTC"})']
    styles = {text.plain[s.start:s.end]: str(s.style) for s in text.spans}
    assert styles["step 9"] == "dim italic" and styles['→ get_current_time({"timezone": "UTC"})'] == "bold yellow"
    assert "the answer" not in styles   # the answer in the normal style, as before


def test_a_turn_without_reasoning_or_calls_draws_as_before():
    assert turn_text(ChatTurn("q", "a")).plain == "you  q\nllm  a"
    assert turn_text(ChatTurn("q")).plain == "you  q\nllm  …"
