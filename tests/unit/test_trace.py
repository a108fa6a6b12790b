"""Traces: seeded generation, the JSONL file, foreign formats, and the two replay loops (no model)."""
from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import random
import statistics

import pytest

from homepd.errors import ConfigError
from homepd.main import main
from homepd.measure.replay import replay
from homepd.measure.trace import (CHARS_PER_TOKEN, OUTPUT_TOKENS, Trace, TraceError, TraceRequest, arrival_offsets,
                                  estimate_tokens, export_records, export_trace, import_trace, make_trace,
                                  parse_trace, read_trace, write_trace)
from homepd.measure.trace import corpus


def gaps(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:])]


def cv(xs):
    return statistics.pstdev(xs) / statistics.fmean(xs)


# --- generation -------------------------------------------------------------------------------------------

def test_one_seed_gives_the_same_schedule_prompts_and_output_counts():
    a = make_trace("mixed", 24, 1.0, arrival="gamma", burstiness=0.5, seed=7)
    b = make_trace("mixed", 24, 1.0, arrival="gamma", burstiness=0.5, seed=7)
    assert a == b
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert [r.messages for r in a] == [r.messages for r in b]
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    c = make_trace("mixed", 24, 1.0, arrival="gamma", burstiness=0.5, seed=8)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c] and [r.text for r in a] != [r.text for r in c]


def test_rate_and_arrival_process_change_the_schedule_only():
    base = make_trace("mixed", 16, 1.0, seed=3)
    for other in (make_trace("mixed", 16, 4.0, seed=3), make_trace("mixed", 16, 1.0, arrival="gamma",
                                                                    burstiness=0.3, seed=3)):
        assert [r.arrival_s for r in other] != [r.arrival_s for r in base]
        assert [(r.messages, r.max_tokens, r.kind) for r in other] == \
               [(r.messages, r.max_tokens, r.kind) for r in base]


def test_poisson_arrivals_have_the_asked_mean_rate_and_exponential_gaps():
    g = gaps(arrival_offsets(20001, 5.0, random.Random(0)))
    assert 1 / statistics.fmean(g) == pytest.approx(5.0, rel=0.03)
    assert cv(g) == pytest.approx(1.0, abs=0.05)


def test_gamma_burstiness_keeps_the_rate_and_below_one_is_burstier():
    by_burstiness = {}
    for b in (0.25, 1.0, 4.0):
        g = gaps(arrival_offsets(20001, 5.0, random.Random(1), arrival="gamma", burstiness=b))
        assert 1 / statistics.fmean(g) == pytest.approx(5.0, rel=0.05)
        by_burstiness[b] = cv(g)
    assert by_burstiness[0.25] > by_burstiness[1.0] > by_burstiness[4.0]
    assert by_burstiness[0.25] == pytest.approx(2.0, rel=0.1)  # cv = 1/sqrt(burstiness)
    assert by_burstiness[1.0] == pytest.approx(1.0, rel=0.1)


def test_arrivals_start_at_zero_are_sorted_and_an_infinite_rate_sends_all_at_once():
    offsets = arrival_offsets(50, 3.0, random.Random(2), arrival="gamma", burstiness=0.5)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert arrival_offsets(4, float("inf"), random.Random(0)) == [0.0] * 4


def test_mixed_is_one_long_in_four_with_classes_and_output_lengths_per_kind():
    trace = make_trace("mixed", 12, 2.0, seed=0)
    assert [r.kind for r in trace] == ["short", "long", "short", "short"] * 3
    for r in trace:
        lo, hi = OUTPUT_TOKENS[r.kind]
        assert lo <= r.max_tokens <= hi and r.ignore_eos
        assert r.request_class == {"short": "interactive", "long": "background"}[r.kind]
        assert r.prompt is None and len(r.messages) == 1 and r.messages[0]["role"] == "user"
    fixed = make_trace("mixed", 12, 2.0, max_tokens=5, ignore_eos=False, seed=0)
    assert {r.max_tokens for r in fixed} == {5} and not any(r.ignore_eos for r in fixed)
    assert [r.messages for r in fixed] == [r.messages for r in trace]  # output lengths draw from their own stream


def test_prompts_are_real_text_from_the_shipped_corpus():
    questions = corpus.chat_questions()
    assert len(questions) >= 40 and all(q.endswith("?") for q in questions)
    docs = corpus.documents()
    assert len(docs) >= 5 and all(len(d.text) > 3000 for d in docs)
    trace = make_trace("mixed", 40, 2.0, seed=1)
    for r in trace:
        if r.kind == "short":
            assert r.text in questions
        else:
            head, body = r.text.split("\n\n", 1)
            assert head.startswith("Summarise this passage from")
            assert body.endswith((".", "?", "!"))
            assert any(body.split("\n\n")[0] in d.text for d in docs)


@pytest.mark.parametrize("long_tokens", [150, 400, 900])
def test_long_prompts_are_about_long_tokens(long_tokens):
    for r in make_trace("long", 20, 1.0, long_tokens=long_tokens, seed=2):
        assert 0.8 * long_tokens <= estimate_tokens(r.text) <= long_tokens


def test_closed_loop_trace_has_its_concurrency_and_no_arrival_times():
    trace = make_trace("short", 6, concurrency=2, seed=0)
    assert trace.concurrency == 2 and {r.arrival_s for r in trace} == {0.0}


@pytest.mark.parametrize("kwargs, needle", [
    ({"mix": "huge"}, "mix"), ({"n_requests": 0}, "at least one"), ({"rate_per_s": 0}, "rate_per_s"),
    ({"arrival": "uniform"}, "arrival"), ({"arrival": "gamma", "burstiness": 0}, "burstiness"),
    ({"concurrency": 0}, "concurrency"), ({"max_tokens": 0}, "max_tokens")])
def test_bad_generator_settings_are_refused(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        make_trace(**kwargs)


# --- the homepd JSONL file --------------------------------------------------------------------------------

def test_jsonl_round_trip_keeps_everything(tmp_path):
    made = make_trace("mixed", 9, 1.5, arrival="gamma", burstiness=0.5, seed=4)
    extra = (TraceRequest(arrival_s=9.5, prompt="Raw text, no template — ünïcode ✓", max_tokens=3, kind="short",
                          request_class="background"),
             TraceRequest(arrival_s=9.75, messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi?"}], max_tokens=4))
    trace = Trace(made.requests + extra, name="mine", seed=4, concurrency=3, generator=made.generator)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    assert json.loads(path.read_text().splitlines()[0])["homepd_trace"] == 1


def test_a_hand_written_file_needs_no_header_and_gets_kind_and_class_from_the_prompt():
    long_text = "word " * 400
    trace = parse_trace([json.dumps({"arrival_s": 0, "prompt": "Hi", "max_tokens": 8}), "",
                         json.dumps({"arrival_s": 1.5, "prompt": long_text, "max_tokens": 8})], name="hand")
    assert [(r.kind, r.request_class, r.ignore_eos) for r in trace] == \
           [("short", "interactive", False), ("long", "background", False)]
    assert trace.name == "hand" and trace.concurrency is None


OK = {"arrival_s": 0.5, "prompt": "Hello", "max_tokens": 8}


@pytest.mark.parametrize("line, field, reason", [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({"prompt": "x", "max_tokens": 8}), "arrival_s", "missing"),
    (json.dumps({**OK, "arrival_s": -1}), "arrival_s", ">= 0"),
    (json.dumps({**OK, "arrival_s": "soon"}), "arrival_s", "number"),
    (json.dumps({**OK, "messages": [{"role": "user", "content": "x"}]}), "prompt", "exactly one"),
    (json.dumps({"arrival_s": 0, "max_tokens": 8}), "messages", "exactly one"),
    (json.dumps({**OK, "prompt": ""}), "prompt", "non-empty"),
    (json.dumps({"arrival_s": 0, "max_tokens": 8, "messages": [{"role": "user"}]}), "messages", "message 0"),
    (json.dumps({"arrival_s": 0, "max_tokens": 8, "messages": []}), "messages", "non-empty"),
    (json.dumps({**OK, "max_tokens": 0}), "max_tokens", ">= 1"),
    (json.dumps({**OK, "max_tokens": 2.5}), "max_tokens", "integer"),
    (json.dumps({**OK, "max_token": 8}), "max_token", "unknown field"),
    (json.dumps({**OK, "kind": "medium"}), "kind", "short, long"),
    (json.dumps({**OK, "request_class": "batch"}), "request_class", "interactive, background"),
    (json.dumps({**OK, "ignore_eos": "yes"}), "ignore_eos", "true or false"),
    (json.dumps({"homepd_trace": 1}), "homepd_trace", "first line"),
])
def test_a_bad_line_is_refused_naming_the_file_line_and_field(tmp_path, line, field, reason):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(OK) + "\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    err = info.value
    assert (err.source, err.line, err.field) == (str(path), 2, field)
    assert str(err).startswith(f"{path}:2: " + (f"field {field!r}: " if field else "")) and reason in str(err)


@pytest.mark.parametrize("header, field", [({"homepd_trace": 2}, "homepd_trace"),
                                           ({"homepd_trace": 1, "concurrency": 0}, "concurrency"),
                                           ({"homepd_trace": 1, "colour": "red"}, "colour")])
def test_a_bad_header_is_refused_naming_its_field(header, field):
    with pytest.raises(TraceError, match=f"t.jsonl:1: field '{field}'"):
        parse_trace([json.dumps(header), json.dumps(OK)], source="t.jsonl")


def test_a_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="nope.jsonl.*cannot read"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="empty.jsonl: no requests"):
        read_trace(tmp_path / "empty.jsonl")


# --- foreign formats --------------------------------------------------------------------------------------

def test_mooncake_export_then_import_keeps_times_lengths_and_output_counts(tmp_path):
    trace = make_trace("mixed", 12, 2.0, seed=5)
    export_trace(trace, tmp_path / "m.jsonl", "mooncake")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["timestamp"] for r in records] == [round(r.arrival_s * 1000) for r in trace]
    back = import_trace(tmp_path / "m.jsonl", "mooncake")
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s for r in trace], abs=5e-4)
    assert [r.max_tokens for r in back] == [r.max_tokens for r in trace]
    assert [estimate_tokens(r.text) for r in back] == [estimate_tokens(r.text) for r in trace]
    assert [r.kind for r in back] == [r.kind for r in trace] and all(r.prompt is not None for r in back)


def test_mooncake_import_then_export_is_the_same_file_and_shared_hash_ids_share_a_prefix(tmp_path):
    records = [{"timestamp": 0, "input_length": 1200, "output_length": 20, "hash_ids": [0, 1, 2]},
               {"timestamp": 250, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
               {"timestamp": 1000, "input_length": 40, "output_length": 7, "hash_ids": [4]},
               {"timestamp": 1500, "input_length": 600, "output_length": 9}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = import_trace(tmp_path / "m.jsonl", "mooncake")
    block = round(512 * CHARS_PER_TOKEN)
    assert trace[0].prompt[:block] == trace[1].prompt[:block] != trace[3].prompt[:block]
    assert trace[0].prompt[block:2 * block] != trace[1].prompt[block:2 * block]
    exported = export_records(trace, "mooncake")
    assert exported[:3] == records[:3]
    assert exported[3] == {**records[3], "hash_ids": [5, 6]}  # ids given to the blocks the file left unnamed


@pytest.mark.parametrize("record, field", [({"input_length": 5, "output_length": 5}, "timestamp"),
                                           ({"timestamp": -1, "input_length": 5, "output_length": 5}, "timestamp"),
                                           ({"timestamp": 0, "input_length": 0, "output_length": 5}, "input_length"),
                                           ({"timestamp": 0, "input_length": 5, "output_length": "5"},
                                            "output_length"),
                                           ({"timestamp": 0, "input_length": 5, "output_length": 5,
                                             "hash_ids": [1, -2]}, "hash_ids")])
def test_a_bad_mooncake_line_names_its_field(tmp_path, record, field):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 5}) + "\n" + json.dumps(record))
    with pytest.raises(TraceError, match=f"m.jsonl:2: field '{field}'"):
        import_trace(path, "mooncake")


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_vllm_and_sglang_round_trip_with_the_same_seed_and_rate_give_back_the_trace(tmp_path, fmt):
    trace = make_trace("mixed", 10, 3.0, arrival="gamma", burstiness=0.5, seed=6)
    export_trace(trace, tmp_path / "x.jsonl", fmt)
    line = json.loads((tmp_path / "x.jsonl").read_text().splitlines()[1])
    assert set(line) == ({"prompt", "output_tokens"} if fmt == "vllm" else {"messages", "max_tokens"})
    back = import_trace(tmp_path / "x.jsonl", fmt, rate_per_s=3.0, arrival="gamma", burstiness=0.5, seed=6)
    assert [(r.arrival_s, r.messages, r.max_tokens, r.kind, r.request_class, r.ignore_eos) for r in back] == \
           [(r.arrival_s, r.messages, r.max_tokens, r.kind, r.request_class, r.ignore_eos) for r in trace]
    closed = import_trace(tmp_path / "x.jsonl", fmt, concurrency=4)
    assert closed.concurrency == 4 and {r.arrival_s for r in closed} == {0.0}


def test_a_raw_prompt_exports_as_one_user_turn():
    trace = Trace((TraceRequest(0.0, prompt="Say hi.", max_tokens=3),))
    assert export_records(trace, "vllm") == [{"prompt": "Say hi.", "output_tokens": 3}]
    assert export_records(trace, "sglang") == [{"messages": [{"role": "user", "content": "Say hi."}],
                                                "max_tokens": 3}]


@pytest.mark.parametrize("fmt, record, field", [("vllm", {"prompt": "x"}, "output_tokens"),
                                                ("vllm", {"prompt": [1, 2], "output_tokens": 3}, "prompt"),
                                                ("vllm", {"prompt": "x", "output_tokens": 0}, "output_tokens"),
                                                ("sglang", {"messages": "x", "max_tokens": 3}, "messages"),
                                                ("sglang", {"messages": [{"role": "user", "content": "x"}]},
                                                 "max_tokens")])
def test_a_bad_vllm_or_sglang_line_names_its_field(tmp_path, fmt, record, field):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(TraceError, match=f"x.jsonl:1: field '{field}'"):
        import_trace(path, fmt)


# --- the command ------------------------------------------------------------------------------------------

def test_trace_make_and_convert_commands(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    args = ["trace", "make", "--mix", "mixed", "--requests", "8", "--rate", "2", "--arrival", "gamma",
            "--burstiness", "0.5", "--seed", "3", "-o", str(out)]
    assert main(args) == 0
    assert read_trace(out).requests == make_trace("mixed", 8, 2.0, arrival="gamma", burstiness=0.5, seed=3).requests
    assert "8 requests (6 short, 2 long)" in capsys.readouterr().err
    assert main(["trace", "convert", "--to", "vllm", str(out), "-o", str(tmp_path / "v.jsonl")]) == 0
    assert "--dataset-name custom" in capsys.readouterr().err
    assert main(["trace", "convert", "--from", "vllm", "--to", "mooncake", str(tmp_path / "v.jsonl")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 8
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt": "x", "max_tokens": 0}\n')
    assert main(["trace", "convert", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1: field 'max_tokens'" in capsys.readouterr().err


# --- replay -----------------------------------------------------------------------------------------------

class FakeClock:
    """Virtual time for the replayer: ``now()`` moves only when every task of the run waits on the clock,
    and then to the earliest wake-up.  Nothing waits in real time."""

    def __init__(self):
        self.now_s = 0.0
        self._order = itertools.count()  # why: equal wake-up times wake in the order they went to sleep
        self._sleepers: list[tuple[float, int, asyncio.Future, asyncio.Task]] = []

    def now(self) -> float:
        return self.now_s

    async def sleep_until(self, t_s: float) -> None:
        if t_s <= self.now_s:
            return
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (t_s, next(self._order), wake, asyncio.current_task()))
        await wake

    async def run(self, coro):
        """Run ``coro`` to its end on this clock."""
        main, me = asyncio.ensure_future(coro), asyncio.current_task()
        while not main.done():
            asleep = {task for *_, task in self._sleepers}
            busy = {t for t in asyncio.all_tasks() if not t.done() and t not in (me, main, *asleep)}
            if busy or not self._sleepers:
                await asyncio.sleep(0)  # let the runnable tasks reach the clock (or finish)
                continue
            t_s, _, wake, _ = heapq.heappop(self._sleepers)
            self.now_s = t_s
            wake.set_result(None)
        return main.result()


class FakeEngine:
    """Counts requests in flight and when each was submitted (on ``clock``); each takes ``service_s``."""

    def __init__(self, clock: FakeClock, service_s: float = 0.02):
        self.clock, self.service_s, self.in_flight, self.max_in_flight = clock, service_s, 0, 0
        self.submitted: list[tuple[float, object, object]] = []
        self.classes: list[str | None] = []

    async def submit(self, prompt=None, *, messages=None, params=None, request_class=None):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.submitted.append((self.clock.now(), prompt or messages, params))
        self.classes.append(request_class)
        return FakeStream(self, len(self.submitted) - 1)


class FakeStream:
    def __init__(self, engine: FakeEngine, index: int):
        self.engine, self.lifecycle = engine, index

    async def collect(self):
        await self.engine.clock.sleep_until(self.engine.clock.now() + self.engine.service_s)
        self.engine.in_flight -= 1


def replay_on(clock: FakeClock, engine: FakeEngine, trace):
    return asyncio.run(clock.run(replay(engine, trace, clock=clock)))


def test_closed_loop_replay_keeps_at_most_n_in_flight_and_returns_trace_order():
    trace = make_trace("mixed", 10, 1.0, concurrency=3, max_tokens=4, seed=0)
    clock = FakeClock()
    engine = FakeEngine(clock, service_s=0.02)
    lifecycles = replay_on(clock, engine, trace)
    assert engine.max_in_flight == 3 and engine.in_flight == 0
    assert sorted(lifecycles) == list(range(10))
    assert [engine.submitted[i][1] for i in lifecycles] == [list(r.messages) for r in trace]
    assert [engine.classes[i] for i in lifecycles] == [r.request_class for r in trace]  # the trace's classes
    assert {"interactive", "background"} <= set(engine.classes)
    # arrival offsets ignored: three lanes, each sending its next request as its last one finishes
    assert [t for t, *_ in engine.submitted] == pytest.approx([0.0] * 3 + [0.02] * 3 + [0.04] * 3 + [0.06])
    assert clock.now() == pytest.approx(0.08)


def test_open_loop_replay_submits_at_the_arrival_offsets_with_the_trace_s_sampling():
    trace = Trace((TraceRequest(0.0, prompt="a", max_tokens=2, ignore_eos=True),
                   TraceRequest(0.1, messages=[{"role": "user", "content": "b"}], max_tokens=3),
                   TraceRequest(0.05, prompt="c", max_tokens=4)))
    clock = FakeClock()
    clock.now_s = 100.0  # offsets count from when the replay starts
    engine = FakeEngine(clock, service_s=0.2)
    lifecycles = replay_on(clock, engine, trace)
    assert [(t, what) for t, what, _ in engine.submitted] == \
           [(100.0, "a"), (100.05, "c"), (100.1, [{"role": "user", "content": "b"}])]
    by_what = {str(what): params for _, what, params in engine.submitted}
    assert (by_what["a"].max_tokens, by_what["a"].ignore_eos) == (2, True)
    assert (by_what["c"].max_tokens, by_what["c"].ignore_eos) == (4, False)
    assert engine.max_in_flight == 3  # open loop: nobody waits for anybody
    assert clock.now() == pytest.approx(100.3)
    assert [engine.submitted[i][1] for i in lifecycles] == ["a", [{"role": "user", "content": "b"}], "c"]


def test_a_tagged_replay_shares_nothing_with_another_but_its_requests_still_share_their_prefixes():
    from homepd.measure.trace.model import Trace, TraceRequest, tagged
    doc = "A long document. " * 20
    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"})
    trace = Trace([TraceRequest(0.0, prompt=doc + "Q1"), TraceRequest(0.5, prompt=doc + "Q2"),
                   TraceRequest(1.0, messages=chat)])
    one, two = tagged(trace, "[probe 1] "), tagged(trace, "[probe 2] ")
    a, b = one.requests[0].prompt, one.requests[1].prompt
    assert a.startswith("[probe 1] " + doc) and b.startswith("[probe 1] " + doc)  # shared within a replay
    assert two.requests[0].prompt != a and not two.requests[0].prompt.startswith("[probe 1]")
    msgs = one.requests[2].messages
    assert msgs[0] == chat[0] and msgs[2] == chat[2]  # the system prompt and the answers are untouched
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["[probe 1] Hi", "[probe 1] Why?"]
    assert [r.arrival_s for r in one.requests] == [r.arrival_s for r in trace.requests]
