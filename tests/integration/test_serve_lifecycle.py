"""``homepd serve`` lifecycle over real HTTP (fake backend, long generations): bounded admission (503 +
Retry-After), a client disconnect frees its sequence, systemd notifications (READY=1, WATCHDOG=1), and
SIGTERM: 503 for new requests, running ones aborted at the drain timeout, exit status 0."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
LONG = {"model": MODEL, "prompt": "go", "max_tokens": 200_000, "stream": True, "ignore_eos": True}


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket whose messages are collected by a thread."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            with self.changed:
                self.messages.extend(data.decode().splitlines())
                self.changed.notify_all()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[str]:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.messages), timeout_s), self.messages
            return list(self.messages)


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    listener = NotifyListener(tmp_path_factory.mktemp("n") / "notify.sock")
    yield listener
    listener.sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, notify):
    proc = ServeProcess(tmp_path_factory.mktemp("life"), "--backend", "fake", "--n-ctx", "300000",
                        "--n-seq-max", "1", "--max-queue", "0", "--max-tokens", "250000", "--drain-timeout", "1",
                        env={"NOTIFY_SOCKET": notify.sock.getsockname(), "WATCHDOG_USEC": "200000"})
    yield proc.wait_ready()
    if proc.process.poll() is None:
        assert proc.terminate() == 0, proc.log()


def first_chunk_id(lines) -> str:
    """The id of the first SSE chunk.  The caller must keep ``lines`` referenced while it needs the stream
    open: a dropped line iterator closes the connection whenever the garbage collector reclaims it."""
    for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])["id"]
    raise AssertionError("stream ended before its first chunk")


def freed(rid: str):
    """/status shows ``rid`` ended as cancelled, nothing in flight, and no worker holding a sequence."""
    def check(status) -> bool:
        engine = status["engine"]
        return (status["admission"]["in_flight"] == 0 and not any(engine["requests"].values())
                and all(not w["in_flight"] for w in engine["workers"])
                and any(r["request_id"] == rid and r["finish_reason"] == "cancelled" for r in status["recent_requests"]))
    return check


def test_ready_and_watchdog_are_notified(server, notify):
    messages = notify.wait_for(lambda m: "READY=1" in m and "WATCHDOG=1" in m[m.index("READY=1"):])
    assert any(m.startswith("STATUS=ready") for m in messages)


def test_client_disconnect_frees_the_sequence(server):
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json=LONG) as response:
            lines = response.iter_lines()
            rid = first_chunk_id(lines)
            running = client.get("/status").json()
            assert rid in sum(running["engine"]["requests"].values(), [])
        # leaving the block closes the connection mid-stream
    server.wait_until(freed(rid), what=f"{rid} cancelled and its sequence freed")


def test_client_that_never_reads_a_byte_frees_its_place_when_it_closes(server):
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        running = server.wait_until(lambda s: any(s["engine"]["requests"].values()), what="the request running")
    rid = sum(running["engine"]["requests"].values(), [])[0]
    server.wait_until(freed(rid), what=f"{rid} cancelled and freed")


def test_non_streaming_disconnect_frees_the_sequence_too(server):
    import httpx

    with server.client() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json={**LONG, "stream": False}, timeout=1.0)  # gives up, disconnects
    status = server.wait_until(lambda s: s["admission"]["in_flight"] == 0 and not any(s["engine"]["requests"].values()),
                               what="the abandoned request freed")
    assert status["recent_requests"][-1]["finish_reason"] == "cancelled"


def test_full_queue_is_503_with_retry_after(server):
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json=LONG) as holder:
            lines = holder.iter_lines()
            rid = first_chunk_id(lines)
            refused = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable_error" and error["code"] == "queue_full"
            assert 'code="queue_full"' in client.get("/metrics").text
    server.wait_until(freed(rid), what="the holder freed")


def test_sigterm_refuses_new_work_aborts_at_the_drain_timeout_and_exits_0(server, notify):
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json=LONG) as response:
            lines = response.iter_lines()
            first_chunk_id(lines)
            t0 = time.monotonic()
            server.process.terminate()  # SIGTERM
            server.wait_until(lambda s: s["state"] == "draining", what="draining")
            refused = client.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert client.get("/ready").status_code == 503
            tail = [line for line in lines if line.startswith("data: ")]
    assert tail[-1] == "data: [DONE]"
    assert json.loads(tail[-2][6:])["error"]["code"] == "aborted"  # still running at the 1 s drain timeout
    assert server.process.wait(30) == 0, server.log()
    assert time.monotonic() - t0 < 20
    assert "STOPPING=1" in notify.wait_for(lambda m: "STOPPING=1" in m)
