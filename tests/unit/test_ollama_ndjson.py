"""Ollama's NDJSON answer of one reply (``homepd.serve.ollama.ndjson``), on a scripted event stream: a tool call
from the generic envelope comes whole with its arguments as an object, the last line has done and the counts,
and an error after the stream began is one more line."""
from __future__ import annotations

import asyncio
import json

from homepd.chat.format import PLAIN
from homepd.core.lifecycle import Lifecycle
from homepd.core.records import FinishReason
from homepd.core.sampling import SamplingParams
from homepd.engine.chatplan import ChatPlan
from homepd.engine.streams import Event, EventKind
from homepd.serve.chat import RequestPlan
from homepd.serve.ollama import ndjson
from homepd.serve.reply import CHAT, Reply


class ScriptedStream:
    def __init__(self, pieces: list[str], end: Event):
        self.request_id, self.lifecycle = "r1", Lifecycle(request_id="r1", arrived_s=0.0, n_prompt_tokens=7)
        self.events = [Event(EventKind.TOKEN, "r1", 0.1 * i, token_id=i, text=p) for i, p in enumerate(pieces)]
        self.events.append(end)

    async def __aiter__(self):
        for event in self.events:
            yield event


def reply_of(pieces: list[str], end: Event, tools: bool) -> Reply:
    plan = ChatPlan(None, [], None, None, PLAIN, tools_active=tools, envelope=tools, tool_names=("HassTurnOn",))
    return Reply(None, CHAT, ScriptedStream(pieces, end), RequestPlan(plan, SamplingParams()), "m:latest", 0, [])


def lines_of(reply: Reply) -> list[dict]:
    async def run():
        return [json.loads(line) async for line in ndjson.lines(reply, True, 0.0)]

    return asyncio.run(run())


def test_a_call_in_the_envelope_is_one_chunk_with_object_arguments_before_the_last():
    text = '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "kitchen", "level": 3}}]}'
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    lines = lines_of(reply_of(pieces, Event(EventKind.DONE, "r1", 9.0, finish_reason=FinishReason.STOP), True))
    calls = [x["message"]["tool_calls"] for x in lines if "tool_calls" in x["message"]]
    assert calls == [[{"id": calls[0][0]["id"], "function": {"index": 0, "name": "HassTurnOn",
                                                             "arguments": {"name": "kitchen", "level": 3}}}]]
    last = lines[-1]
    assert last["done"] and last["done_reason"] == "stop" and last["prompt_eval_count"] == 7
    assert all(isinstance(last[k], int) for k in ("total_duration", "load_duration", "eval_duration"))
    assert not any(x["done"] for x in lines[:-1])


def test_an_error_after_the_stream_began_is_one_more_line():
    end = Event(EventKind.ERROR, "r1", 1.0, error="the decode worker died")
    lines = lines_of(reply_of(["Hel", "lo"], end, False))
    assert [x["message"]["content"] for x in lines[:2]] == ["Hel", "lo"]
    assert lines[-1] == {"error": "the request failed: the decode worker died"}
