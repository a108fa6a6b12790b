"""Live advice over real HTTP (fake backend, constructed evidence in a real store): traffic that shifts from
short chats to long documents raises a switch advice naming its evidence, ``/advice``, ``/metrics`` and
``/events`` agree, and ``POST /advice/apply`` drains and switches with every request completed.

The evaluation is driven by ``POST /advice/evaluate`` (the periodic one is set to an hour) and the
hysteresis is 0 here (the pure tests cover it); the advice window is 2 s, so the client sends documents for
one window after the chats: the workload's shape, not a synchronisation."""
from __future__ import annotations

import json
import threading
import time

import pytest

from homepd.core.terms import RequestClass

from live_evidence import CO, DI, store_evidence
from test_serve_harness import ServeProcess

# switches the service to disaggregated (tests/conftest.py, BoxShare); alone, as test_disaggregated_failures.py says
pytestmark = pytest.mark.whole_box

MODEL = "smollm2-135m-instruct-q4_1"
WINDOW_S = 2.0
N_STREAM_TOKENS = 1500  # the fake backend streams well under 1000 tokens/s here: still running when the apply lands
SHAPES = {"short": (54, RequestClass.INTERACTIVE, 8), "long": (625, RequestClass.BACKGROUND, 8)}
CAPACITIES = {(CO, "short"): (64.0, 8.0), (DI, "short"): (16.0, 4.0), (CO, "long"): (4.0, 1.0),
              (DI, "long"): (32.0, 8.0)}
DOCUMENT = ("Summarise: the box serves chats and documents on two cores; prefill of a long prompt stalls the "
            "decode of every stream beside it unless it is chunked or moved to its own worker. " * 4)[:600]


class EventReader:
    """``/events`` read by a thread; every (event, data) is kept and waiters synchronise on a condition."""

    def __init__(self, proc: ServeProcess):
        self.proc, self.events, self.changed = proc, [], threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.proc.client(timeout=60.0) as client:
            with client.stream("GET", "/events", params={"interval_s": 0.2}) as response:
                kind = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        with self.changed:
                            self.events.append((kind, json.loads(line[6:])))
                            self.changed.notify_all()
                    if self._stop:
                        return

    def wait_for(self, predicate, what: str, timeout_s: float = 60.0):
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.events), timeout_s), f"no {what}: {self.events[-3:]}"
            return next(d for k, d in reversed(self.events) if predicate([(k, d)]))

    def close(self) -> None:
        self._stop = True
        self.thread.join(10.0)


def chat(client, content: str, request_class: str) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "ignore_eos": True,
        "request_class": request_class})
    assert r.status_code == 200, r.text
    return r.json()


def advice_of(kind: str):
    return lambda events: any(k == "advice" and d.get("kind") == kind for k, d in events)


def test_a_shift_to_documents_raises_switch_advice_and_apply_switches_with_every_request_completed(tmp_path):
    run = store_evidence(tmp_path / "homepd.db", SHAPES, CAPACITIES)
    proc = ServeProcess(tmp_path, "--backend", "fake", "--n-ctx", "32768", "--max-tokens", str(N_STREAM_TOKENS),
                        "--advice-windows", "2s,1m", "--advice-hysteresis", "0", "--advice-period", "1h",
                        "--advice-min-requests", "4").wait_ready()
    events = EventReader(proc)
    try:
        events.wait_for(lambda evs: any(k == "snapshot" for k, _ in evs), "first snapshot")  # subscribed
        with proc.client() as client:
            for i in range(6):
                chat(client, f"What is a KV cache, question {i}?", "interactive")
            last_chat_s = time.monotonic()
            before = client.post("/advice/evaluate").json()
            assert before["running"] == CO and before["evidence"]["run_id"] == run
            assert (before["current"]["kind"], before["current"]["mix"]) == ("keep", "short"), before["current"]
            shift_unix_s = time.time()
            n_documents = 0
            while n_documents < 4 or time.monotonic() - last_chat_s <= WINDOW_S + 0.1:
                chat(client, f"{n_documents} {DOCUMENT}", "background")
                n_documents += 1
            after = client.post("/advice/evaluate").json()
            raised = events.wait_for(advice_of("switch"), "switch advice event")
            assert (after["current"]["kind"], after["current"]["candidate"], after["current"]["mix"]) == \
                ("switch", DI, "long"), after["current"]
            assert [(r["run_id"], r["candidate"], r["mix"], r["capacity_rps"]) for r in raised["evidence"]] == [
                (run, DI, "long", 32.0), (run, CO, "long", 4.0)]
            assert raised["live"]["window_s"] == WINDOW_S and raised["live"]["n_requests"] >= 4
            assert raised["live"]["long_share"] == 1.0 and raised["margin_rps"] == 28.0
            assert shift_unix_s <= raised["held_since_unix_s"] <= raised["raised_unix_s"] <= time.time()
            state = client.get("/advice").json()
            assert state["advice"] == raised and state["history"] == [raised]
            metrics = client.get("/metrics").text
            assert f'homepd_advice{{candidate="{DI}",kind="switch"}} 1.0' in metrics
            assert 'homepd_advice_events_total{kind="switch"} 1.0' in metrics
            assert f'homepd_advice_headroom_ratio{{candidate="{DI}",mix="long"}}' in metrics

            applied, served_after = [], []

            def apply() -> None:
                with proc.client() as c:
                    applied.append(c.post("/advice/apply", json={}))

            def late_chat() -> None:
                with proc.client() as c:
                    served_after.append(chat(c, "after?", "interactive"))

            with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "go", "max_tokens": N_STREAM_TOKENS, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}) as running:
                lines = running.iter_lines()  # kept referenced: a dropped iterator closes the stream
                assert any(line.startswith("data: {") for line in lines)
                applier = threading.Thread(target=apply)
                applier.start()
                proc.wait_until(lambda s: s["state"] == "switching", what="the switch draining")
                late = threading.Thread(target=late_chat)
                late.start()
                data = [line[6:] for line in lines if line.startswith("data: ")]
            assert data[-1] == "[DONE]" and not any('"error"' in d for d in data)
            assert json.loads(data[-2])["usage"]["completion_tokens"] == N_STREAM_TOKENS
            applier.join(60.0)
            late.join(60.0)
            assert applied and applied[0].status_code == 200, applied and applied[0].text
            record = applied[0].json()
            assert record["candidate"] == DI and record["drained_requests"] >= 1 and record["run_id"] == run
            assert served_after and served_after[0]["homepd"]["mode"] == "disaggregated"
            switched = events.wait_for(advice_of("switch-applied"), "switch event")
            assert switched["candidate"] == DI and switched["evidence"]["candidate"] == DI
            status = client.get("/status").json()
            assert status["configuration"]["candidate"] == DI and status["state"] == "ready"
            assert client.get("/advice").json()["running"] == DI
    finally:
        events.close()
        assert proc.terminate() == 0, proc.log()
