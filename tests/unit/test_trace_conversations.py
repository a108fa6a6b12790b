"""Chat and RAG traces: conversations with think time and shared documents, their file, their exports, and a
replay that is closed within a conversation and open across conversations (no model, virtual time)."""
from __future__ import annotations

import json

import pytest

from homepd.main import main
from homepd.measure.trace import (CHARS_PER_TOKEN, Trace, TraceError, TraceRequest, export_records, import_trace,
                                  make_trace, parse_trace, read_trace, write_trace)
from homepd.measure.trace.conversations import SYSTEM_PROMPT
from test_trace import FakeClock, FakeEngine, replay_on


def by_conversation(trace) -> dict[int, list[TraceRequest]]:
    out: dict[int, list[TraceRequest]] = {}
    for r in trace:
        out.setdefault(r.conversation, []).append(r)
    return out


def test_chat_turns_resend_the_history_with_answers_at_their_output_lengths():
    trace = make_trace("chat", 10, 0.5, turns=4, think_s=3.0, seed=3)
    assert trace == make_trace("chat", 10, 0.5, turns=4, think_s=3.0, seed=3)  # one seed, one trace
    convs = by_conversation(trace)
    assert [len(turns) for turns in convs.values()] == [4, 4, 2]  # the last conversation is shorter
    for turns in convs.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert turns[0].think_s == 0 and all(t.think_s > 0 for t in turns[1:])
        assert turns[0].messages[0] == {"role": "system", "content": SYSTEM_PROMPT}  # the shared fixed head
        for prev, turn in zip(turns, turns[1:]):
            n = len(prev.messages)
            assert turn.messages[:n] == prev.messages  # the whole history again
            answer = turn.messages[n]
            assert answer["role"] == "assistant" and turn.messages[n + 1]["role"] == "user"
            assert len(answer["content"]) == pytest.approx(prev.max_tokens * CHARS_PER_TOKEN, abs=4)
            assert turn.arrival_s == pytest.approx(prev.arrival_s + turn.think_s, abs=1e-3)  # earliest send time
        assert all(t.kind == "chat" and t.request_class == "interactive" and t.ignore_eos for t in turns)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert make_trace("chat", 10, 0.5, seed=4) != trace


def test_rag_questions_share_their_document_passage_as_a_prefix():
    trace = make_trace("rag", 9, 2.0, documents=3, long_tokens=200, seed=1)
    heads = [r.messages[0]["content"].rsplit("\n\nQuestion: ", 1) for r in trace]
    passages = {passage for passage, _ in heads}
    assert len(passages) == 3 and all(len(p) <= 200 * CHARS_PER_TOKEN for p in passages)
    for passage in passages:
        questions = [q for p, q in heads if p == passage]
        assert len(questions) == 3 and len(set(questions)) == 3  # several different questions per document
    assert len({p.split('"')[1] for p in passages}) == 3  # three different corpus documents
    assert all(r.kind == "rag" and r.conversation is None for r in trace)


def test_chat_and_rag_round_trip_through_the_homepd_file(tmp_path):
    for mix in ("chat", "rag"):
        trace = make_trace(mix, 7, 1.0, seed=2)
        write_trace(trace, tmp_path / f"{mix}.jsonl")
        back = read_trace(tmp_path / f"{mix}.jsonl")
        assert back.requests == trace.requests and back.generator == trace.generator
    line = json.loads((tmp_path / "chat.jsonl").read_text().splitlines()[2])
    assert {"conversation", "turn", "think_s"} <= set(line)


def conversation_lines(*turns: dict) -> list[str]:
    return [json.dumps({"arrival_s": 0.0, "max_tokens": 4, "kind": "chat", **t}) for t in turns]


USER_A = [{"role": "user", "content": "a"}]
TURN_1 = USER_A + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]


@pytest.mark.parametrize("turns, field, match", [
    ([{"messages": USER_A, "conversation": 0, "turn": 1}], "turn", "turn 1 where turn 0 was due"),
    ([{"messages": USER_A, "conversation": 0}, {"messages": [{"role": "user", "content": "b"}] * 3,
                                                "conversation": 0, "turn": 1}], "messages", "does not resend"),
    ([{"messages": USER_A, "conversation": 0}, {"messages": USER_A + USER_A, "conversation": 0, "turn": 1}],
     "messages", "does not resend"),
    ([{"messages": USER_A, "turn": 2}], "turn", "0 outside a conversation"),
    ([{"prompt": "raw", "conversation": 1}], "conversation", "must be a chat"),
    ([{"messages": USER_A, "conversation": 0, "think_s": -1}], "think_s", ">= 0"),
    ([{"messages": USER_A, "conversation": "c"}], "conversation", "integer"),
])
def test_a_bad_conversation_is_refused_naming_the_field(turns, field, match):
    with pytest.raises(TraceError, match=match) as info:
        parse_trace(conversation_lines(*turns), source="conv.jsonl")
    assert info.value.field == field and info.value.source == "conv.jsonl"


def test_a_well_formed_two_turn_file_parses():
    trace = parse_trace(conversation_lines({"messages": USER_A, "conversation": 5},
                                           {"messages": TURN_1, "conversation": 5, "turn": 1, "think_s": 2.5}))
    assert [(r.conversation, r.turn, r.think_s) for r in trace] == [(5, 0, 0.0), (5, 1, 2.5)]


def test_chat_exports_to_vllm_and_sglang_and_is_refused_by_mooncake(tmp_path):
    trace = make_trace("chat", 6, 1.0, turns=3, seed=0)
    with pytest.raises(TraceError, match="cannot be exported to mooncake.*think time"):
        export_records(trace, "mooncake")
    sglang = export_records(trace, "sglang")
    assert [rec["messages"] for rec in sglang] == [list(r.messages) for r in trace]  # each turn with its history
    vllm = export_records(trace, "vllm")
    assert all(rec["prompt"].startswith(f"system: {SYSTEM_PROMPT}") for rec in vllm)
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(rec) + "\n" for rec in sglang))
    back = import_trace(path, "sglang", seed=0)
    assert [r.messages for r in back] == [r.messages for r in trace]  # the prompts survive; the structure does not
    assert main(["trace", "convert", "--to", "mooncake", str(_written(trace, tmp_path))]) == 1


def _written(trace: Trace, tmp_path) -> str:
    path = tmp_path / "chat.jsonl"
    write_trace(trace, path)
    return str(path)


def test_rag_exports_everywhere_and_mooncake_shares_the_document_blocks():
    trace = make_trace("rag", 6, 1.0, documents=2, long_tokens=1100, seed=0)  # over two 512-token blocks
    records = export_records(trace, "mooncake")
    by_passage: dict[str, set] = {}
    for r, rec in zip(trace, records):
        by_passage.setdefault(r.text.rsplit("\n\nQuestion: ", 1)[0], set()).add(rec["hash_ids"][0])
    assert len(by_passage) == 2 and all(len(ids) == 1 for ids in by_passage.values())  # one first block per doc
    assert len({next(iter(ids)) for ids in by_passage.values()}) == 2
    assert len(export_records(trace, "vllm")) == len(export_records(trace, "sglang")) == 6


def test_trace_make_kind_chat_writes_a_conversation_file(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    assert main(["trace", "make", "--kind", "chat", "--requests", "6", "--turns", "3", "--think-s", "1.5",
                 "-o", str(out)]) == 0
    assert "6 chat turns in 2 conversations" in capsys.readouterr().err
    trace = read_trace(out)
    assert {r.conversation for r in trace} == {0, 1} and trace.generator["think_s"] == 1.5


# --- replay -----------------------------------------------------------------------------------------------

def two_conversations() -> Trace:
    def turn(conv, k, arrival, think, n_messages):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{conv}-{i}"}
                for i in range(n_messages)]
        return TraceRequest(arrival, messages=msgs, max_tokens=2, kind="chat", conversation=conv, turn=k,
                            think_s=think)
    return Trace((turn(0, 0, 0.0, 0.0, 1), turn(1, 0, 0.5, 0.0, 1), turn(0, 1, 1.0, 1.0, 3),
                  turn(1, 1, 2.5, 2.0, 3), turn(0, 2, 3.0, 2.0, 5)))


def test_chat_replay_sends_each_turn_its_think_time_after_the_previous_one_ended():
    trace = two_conversations()
    clock = FakeClock()
    engine = FakeEngine(clock, service_s=0.3)
    lifecycles = replay_on(clock, engine, trace)
    sent = {(what[-1]["content"]): t for t, what, _ in engine.submitted}
    # conversation 0: 0.0, ends 0.3, +1.0 think -> 1.3, ends 1.6, +2.0 -> 3.6 (not the nominal 1.0 and 3.0)
    assert sent["0-0"] == 0.0 and sent["0-2"] == pytest.approx(1.3) and sent["0-4"] == pytest.approx(3.6)
    # conversation 1 starts at its own offset while conversation 0 is in flight: open across conversations
    assert sent["1-0"] == pytest.approx(0.5) and sent["1-2"] == pytest.approx(2.8)
    assert [engine.submitted[i][1] for i in lifecycles] == [list(r.messages) for r in trace]  # trace order


def test_closed_loop_chat_replay_keeps_n_conversations_in_flight():
    trace = Trace(two_conversations().requests, concurrency=1)
    clock = FakeClock()
    engine = FakeEngine(clock, service_s=0.3)
    replay_on(clock, engine, trace)
    order = [what[-1]["content"] for _, what, _ in engine.submitted]
    assert order == ["0-0", "0-2", "0-4", "1-0", "1-2"]  # one conversation at a time, each whole
    assert engine.max_in_flight == 1
    assert [t for t, *_ in engine.submitted] == pytest.approx([0.0, 1.3, 3.6, 3.9, 6.2])
