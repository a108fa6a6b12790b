"""The traffic recording over real HTTP (fake backend, real sqlite), and ``homepd advise --traffic service``
replaying it: lengths, classes and prefix shares recorded, no text unless asked, none at all with
--no-record-traffic, and the replay's schedule the recording's."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from homepd.engine.prompt import chat_tokens, prompt_tokens
from homepd.fakellm import FakeModel
from homepd.measure.trace.prefixes import BLOCK_TOKENS
from homepd.store import Store
from homepd.store.traffic import traffic_since

from test_serve_harness import ServeProcess
from homepd.osutil import die_with_parent

MODEL = "smollm2-135m-instruct-q4_1"
SHARED = "You are a careful assistant for a home lab. Answer briefly and precisely. "
GAP_S = 0.4  # the think time between the client's requests: the workload's shape, not a synchronisation


def chat_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": SHARED + question}]


REQUESTS = [  # (route, body extras, header class)
    ("chat", {"messages": chat_messages("What is a KV cache?"), "max_tokens": 5}, None),
    ("chat", {"messages": chat_messages("Why does prefill stall decode on one core?"), "max_tokens": 9,
              "request_class": "background"}, None),
    ("completions", {"prompt": "Unrelated raw text, nothing like the chats.", "max_tokens": 3, "stream": True,
                     "stream_options": {"include_usage": True}}, "background"),
    ("chat", {"messages": chat_messages("What is a KV cache?"), "max_tokens": 4}, None),
]


def send_all(proc: ServeProcess) -> list[dict]:
    """Send REQUESTS GAP_S apart; return (id, usage) of each."""
    out = []
    with proc.client() as client:
        for i, (route, extra, klass) in enumerate(REQUESTS):
            if i:
                time.sleep(GAP_S)
            headers = {"X-Homepd-Class": klass} if klass else {}
            r = client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                            json={"model": MODEL, **extra}, headers=headers)
            assert r.status_code == 200, r.text
            if extra.get("stream"):
                chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                out.append({"id": chunks[0]["id"], "usage": chunks[-1]["usage"]})
            else:
                out.append({"id": r.json()["id"], "usage": r.json()["usage"]})
    return out


def expected_ids(route: str, extra: dict) -> list[int]:
    tok = FakeModel()
    return chat_tokens(tok, extra["messages"]) if route == "chat" else prompt_tokens(tok, extra["prompt"])


def shared_blocks(a: list[int], b: list[int]) -> int:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traffic")
    db = tmp / "store.db"
    proc = ServeProcess(tmp, "--backend", "fake", "--n-ctx", "1024", "--db", str(db)).wait_ready()
    try:
        sent = send_all(proc)
        status = proc.client().get("/status").json()["traffic"]
    finally:
        assert proc.terminate() == 0, proc.log()  # the drain flushes the recorder
    with Store.open(db) as store:
        rows = traffic_since(store, 0)
    return db, sent, rows, status


def test_the_service_records_lengths_classes_prefix_shares_and_no_text(recording):
    _, sent, rows, status = recording
    assert status["recording"] is True and status["text"] is False
    assert [r.request_id for r in rows] == [s["id"] for s in sent]
    assert [r.n_prompt_tokens for r in rows] == [s["usage"]["prompt_tokens"] for s in sent]
    assert [r.n_prompt_tokens for r in rows] == [len(expected_ids(route, x)) for route, x, _ in REQUESTS]
    assert [r.n_output_tokens for r in rows] == [s["usage"]["completion_tokens"] for s in sent] == [5, 9, 3, 4]
    assert [r.request_class for r in rows] == ["interactive", "background", "background", "interactive"]
    assert [r.route for r in rows] == ["chat", "chat", "completions", "chat"]
    ids = [expected_ids(route, x) for route, x, _ in REQUESTS]
    assert rows[0].n_prefix_tokens == 0 and rows[2].n_prefix_tokens == 0
    assert rows[1].n_prefix_tokens == shared_blocks(ids[0], ids[1]) >= 4 * BLOCK_TOKENS
    assert rows[1].prefix_parent == rows[0].request_id
    assert rows[3].n_prefix_tokens == len(ids[3]) // BLOCK_TOKENS * BLOCK_TOKENS  # the same chat again
    assert rows[3].prefix_parent == rows[0].request_id
    assert all(r.prompt_text is None for r in rows)
    gaps = [b.arrived_unix_s - a.arrived_unix_s for a, b in zip(rows, rows[1:])]
    assert all(g >= GAP_S for g in gaps)


def test_text_is_recorded_only_with_record_text_and_nothing_without_recording(tmp_path):
    db = tmp_path / "text.db"
    proc = ServeProcess(tmp_path, "--backend", "fake", "--db", str(db), "--record-text").wait_ready()
    try:
        with proc.client() as client:
            assert client.post("/v1/completions", json={"model": MODEL, "prompt": "keep me", "max_tokens": 2}
                               ).status_code == 200
    finally:
        assert proc.terminate() == 0, proc.log()
    with Store.open(db) as store:
        assert [r.prompt_text for r in traffic_since(store, 0)] == ["keep me"]

    off = tmp_path / "off.db"
    proc = ServeProcess(tmp_path, "--backend", "fake", "--db", str(off), "--no-record-traffic").wait_ready()
    try:
        with proc.client() as client:
            assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                               ).status_code == 200
            assert client.get("/status").json()["traffic"] == {"recording": False}
    finally:
        assert proc.terminate() == 0, proc.log()
    assert not off.exists()


def homepd(*args):
    return subprocess.run([sys.executable, "-m", "homepd", *args], capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent)


def test_advise_traffic_service_replays_the_recorded_schedule(recording):
    db, _, rows, _ = recording
    out = homepd("advise", "--quick", "--no-pictures", "--backend", "fake", "--db", str(db), "--traffic", "service",
                 "--json", "--no-recovery", "--candidates", "colocated-adaptive,disaggregated", "--twin-seeds", "5",
                 "--twin-requests", "50")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs = [r for r in result["runs"] if r["mix"] == "traffic"]
    assert runs and {r["mix"] for r in result["runs"]} == {"traffic"}
    # the capacity search replays the recording at each probe's rate, cycled to the probe's length (>= 10
    # requests): the lengths and classes are the recording's, in its order (its schedule's scaling:
    # trace_at_rate's own tests)
    curves = [r["capacity"] for r in result["evidence"] if r.get("capacity")]
    assert curves and all(c["mix"] == "traffic" and c["probes"] for c in curves)
    for run in runs:
        reqs = sorted(run["record"]["requests"], key=lambda q: q["arrived_s"])
        cycled = [rows[i % len(rows)] for i in range(len(reqs))]
        assert len(reqs) >= 10
        # each probe's requests carry its tag ("[probe N] " before the user text: no probe is served from an
        # earlier probe's cached KV): the same few tokens more on every request of the probe, nothing else
        extra = {q["n_prompt_tokens"] - r.n_prompt_tokens for q, r in zip(reqs, cycled)}
        assert len(extra) == 1 and 0 < extra.pop() <= 16, extra
        assert [q["request_class"] for q in reqs] == [r.request_class for r in cycled]
        assert [q["n_output_tokens"] for q in reqs] == [r.n_output_tokens for r in cycled]
        # the schedule: the recording's arrival offsets, scaled by one factor (the probe's rate over the
        # recorded rate); arrivals are the engine's clock, so within a few tens of ms
        recorded = [r.arrived_unix_s - rows[0].arrived_unix_s for r in rows]
        replayed = [q["arrived_s"] - reqs[0]["arrived_s"] for q in reqs[:len(rows)]]
        scale = replayed[-1] / recorded[-1]
        assert scale > 0 and replayed == pytest.approx([x * scale for x in recorded], abs=0.15)
    assert result["recommendation"]["per_mix"][0]["mix"] == "traffic"


def test_advise_traffic_errors_name_what_is_wrong(recording, tmp_path):
    db = recording[0]
    missing = homepd("advise", "--backend", "fake", "--db", str(tmp_path / "none.db"), "--traffic", "service")
    assert missing.returncode != 0 and "no homepd store at" in missing.stderr
    bad = homepd("advise", "--backend", "fake", "--db", str(db), "--traffic", "service:yesterday")
    assert bad.returncode != 0 and "cannot read SINCE 'yesterday'" in bad.stderr
    empty = homepd("advise", "--backend", "fake", "--db", str(db), "--traffic", "service:2099-01-01T00:00")
    assert empty.returncode != 0 and "no recorded traffic" in empty.stderr and "it holds 4 requests" in empty.stderr
    wrong = homepd("advise", "--backend", "fake", "--db", str(db), "--traffic", "server:2h")
    assert wrong.returncode != 0 and "--traffic takes 'service'" in wrong.stderr
    small = homepd("advise", "--backend", "fake", "--db", str(db), "--traffic", "service", "--n-ctx", "64")
    assert small.returncode != 0 and "more than the campaign's context of 64: pass --n-ctx" in small.stderr
    unknown = homepd("advise", "--quick", "--backend", "fake", "--db", str(db), "--candidates", "colocated-x")
    assert unknown.returncode != 0 and "colocated-x not a candidate here; the candidates are" in unknown.stderr
    few = homepd("advise", "--quick", "--backend", "fake", "--db", str(db), "--twin-seeds", "3")
    assert few.returncode != 0 and "--twin-seeds must be at least 5" in few.stderr
    short = homepd("advise", "--quick", "--backend", "fake", "--db", str(db), "--twin-requests", "20")
    assert short.returncode != 0 and "--twin-requests must be at least 50" in short.stderr


def test_advise_trace_file_replays_that_file_and_names_a_bad_one(tmp_path):
    from homepd.measure.trace import make_trace, write_trace

    trace = make_trace("mixed", 5, 4.0, max_tokens=6, seed=3)
    path = tmp_path / "mine.jsonl"
    write_trace(trace, path)
    out = homepd("advise", "--quick", "--no-pictures", "--backend", "fake", "--db", str(tmp_path / "r.db"),
                 "--trace-file", str(path), "--json", "--no-recovery", "--candidates", "colocated-adaptive",
                 "--twin-seeds", "5", "--twin-requests", "50")
    assert out.returncode == 0, out.stderr
    # --no-pictures: the result file alone (test_advise's quick campaign draws them)
    assert "pictures:" not in out.stderr and [p.suffix for p in (tmp_path / "advise").iterdir()] == [".json"]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["runs"] and {r["mix"] for r in result["runs"]} == {"trace"}
    for run in result["runs"]:   # at the probe's rate, the file cycled to the probe's length
        reqs = sorted(run["record"]["requests"], key=lambda q: q["arrived_s"])
        cycled = [trace.requests[i % len(trace.requests)] for i in range(len(reqs))]
        assert [q["n_output_tokens"] for q in reqs] == [r.max_tokens for r in cycled]
        assert [q["request_class"] for q in reqs] == [r.request_class for r in cycled]
    missing = homepd("advise", "--backend", "fake", "--trace-file", str(tmp_path / "nope.jsonl"))
    assert missing.returncode != 0 and "cannot read the trace file" in missing.stderr
