"""Slow clients cannot lock the service out (issue 28), over real HTTP on the fake backend: a body that does
not arrive in time is a 408 and its connection closed; at the connection cap the oldest connection still
sending its request is closed to make room, so that ``/health`` and a chat get in through a flood of stalled
headers or stalled bodies; the cap follows a descriptor limit lowered on the running service; and the
request-shape errors of a JSON route (Content-Type, a repeated class header, nesting) say what to send."""
from __future__ import annotations

import json
import select
import socket
import subprocess
import time

import httpx
import pytest

from homepd.serve.connections import FDS_RESERVED
from test_serve_harness import ServeProcess

MODEL = "smollm2-135m-instruct-q4_1"
BODY_TIMEOUT_S = 1.0
FD_LIMIT = 256
CAP = FD_LIMIT - FDS_RESERVED  # 128 connections
FLOOD = 200                    # stalled sockets: beyond that cap
N_HEALTH_CHECKS = 20
LONG_TIMEOUT_S = "30"  # header and body deadlines far beyond a flood test: only eviction can let /health in


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("slow"), "--backend", "fake", "--n-ctx", "512",
                        "--header-timeout", "5", "--body-timeout", str(BODY_TIMEOUT_S), api_key=None)
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


def chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


STALLED_BODIES = {
    "content-length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": ",
    "chunked": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n9\r\n{\"model\":\r\n",
}
STALLED_HEADERS = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def stalled_socket(port: int, request: bytes) -> socket.socket | None:
    """A connection that sends the start of ``request`` and never the rest (None: the connection failed)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        return None
    try:
        sock.sendall(request)
    except OSError:  # closed by the server already: what a client may see at the cap
        pass
    return sock


def closed_by_the_server(socks: list[socket.socket | None]) -> list[socket.socket]:
    """Those of ``socks`` with something to read now: an answer, or the end of the stream."""
    poller, by_fd = select.poll(), {}
    for sock in socks:
        if sock is not None:
            poller.register(sock, select.POLLIN)
            by_fd[sock.fileno()] = sock
    return [by_fd[fd] for fd, _ in poller.poll(0)]


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(status line and headers, body) of one response with a Content-Length; b"", b"" if closed without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return b"", b""
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head, body


@pytest.mark.parametrize("framing", sorted(STALLED_BODIES))
def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closed(server, framing):
    with stalled_socket(server.port, STALLED_BODIES[framing]) as sock:
        sock.settimeout(BODY_TIMEOUT_S + 5)
        started = time.monotonic()
        head, body = read_response(sock)
        elapsed_s = time.monotonic() - started
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower(), head
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error", error
        assert "--body-timeout" in error["message"], error
        assert sock.recv(4096) == b""  # then closed
    assert BODY_TIMEOUT_S * 0.9 <= elapsed_s < BODY_TIMEOUT_S + 5
    assert "Traceback" not in server.log()


def test_a_body_sent_in_time_is_served(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200


def flooded_server(tmp_path) -> ServeProcess:
    return ServeProcess(tmp_path, "--backend", "fake", "--header-timeout", LONG_TIMEOUT_S,
                        "--body-timeout", LONG_TIMEOUT_S, api_key=None,
                        wrapper=("prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--")).wait_ready()


def fresh_connections(proc: ServeProcess) -> httpx.Client:
    """A client that opens a new connection for every request, so that each one has to get in past the cap."""
    return httpx.Client(base_url=proc.url, timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.mark.parametrize("stall", ["headers", "body"])
def test_health_and_a_chat_get_in_through_a_flood_of_stalled_requests_at_the_cap(tmp_path, stall):
    """The issue's attack: more stalled sockets than the cap, and more of them between the checks.  Before,
    the cap closed every new connection, /health with them, until the stalled ones timed out."""
    request = STALLED_HEADERS if stall == "headers" else STALLED_BODIES["content-length"]
    proc = flooded_server(tmp_path)
    flood: list[socket.socket | None] = []
    try:
        flood += [stalled_socket(proc.port, request) for _ in range(FLOOD)]
        with fresh_connections(proc) as c:
            for i in range(N_HEALTH_CHECKS):
                assert c.get("/health").status_code == 200, f"/health {i}"
                if i == N_HEALTH_CHECKS // 2:
                    response = c.post("/v1/chat/completions", json=chat())
                    assert response.status_code == 200, response.text
                flood += [stalled_socket(proc.port, request) for _ in range(10)]  # the flood goes on
        # the oldest were closed to make room; one whose headers were in is told why
        answers = [read_response(sock)[0][:12] for sock in closed_by_the_server(flood)]
        assert len(answers) >= len(flood) - 2 * CAP, len(answers)  # most of the flood, as the cap is 128
        if stall == "body":
            assert set(answers) <= {b"HTTP/1.1 408", b""} and b"HTTP/1.1 408" in answers, set(answers)
        else:
            assert set(answers) == {b""}
        assert proc.log_path.stat().st_size < 100_000, proc.log()[-3000:]
    finally:
        for sock in flood:
            if sock is not None:
                sock.close()
        assert proc.terminate() == 0, proc.log()


def test_the_cap_follows_a_descriptor_limit_lowered_on_the_running_service(tmp_path):
    """300 stalled sockets are within the cap at the start-up limit; lowering the limit to 256 (prlimit --pid)
    leaves no descriptor to accept with.  Before, the cap stayed the start-up one and /health was down until
    the header deadline closed the stalled sockets."""
    proc = ServeProcess(tmp_path, "--backend", "fake", "--header-timeout", LONG_TIMEOUT_S, api_key=None).wait_ready()
    flood: list[socket.socket | None] = []
    try:
        flood += [stalled_socket(proc.port, STALLED_HEADERS) for _ in range(300)]
        with fresh_connections(proc) as c:
            # accepted in order: once this is answered, the server holds every stalled socket
            assert c.get("/health").status_code == 200
            subprocess.run(["prlimit", "--pid", str(proc.process.pid), f"--nofile={FD_LIMIT}:{FD_LIMIT}"], check=True)
            for i in range(N_HEALTH_CHECKS):
                assert c.get("/health").status_code == 200, f"/health {i}"
            response = c.post("/v1/chat/completions", json=chat())
            assert response.status_code == 200, response.text
        assert proc.log_path.stat().st_size < 100_000, proc.log()[-3000:]
    finally:
        for sock in flood:
            if sock is not None:
                sock.close()
        assert proc.terminate() == 0, proc.log()


CHAT_BODY = json.dumps(chat())


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_route_without_a_json_content_type_says_to_send_one(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        response = c.post("/v1/chat/completions", content=CHAT_BODY, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "Content-Type: application/json" in error["message"] and error["code"] == "invalid_content_type", error


def test_two_different_class_headers_are_400_naming_the_header(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        twice = [("X-Homepd-Class", "background"), ("X-Homepd-Class", "interactive")]
        response = c.post("/v1/chat/completions", json=chat(), headers=twice)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "X-Homepd-Class" and "X-Homepd-Class" in error["message"], error
        same = [("X-Homepd-Class", "background"), ("X-Homepd-Class", "Background")]
        assert c.post("/v1/chat/completions", json=chat(), headers=same).status_code == 200


def test_json_nested_too_deeply_is_400_with_a_code(server):
    body = '{"model": "m", "messages": ' + "[" * 30_000 + "]" * 30_000 + "}"
    with httpx.Client(base_url=server.url, timeout=10) as c:
        response = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and "nested" in error["message"], error
        assert c.get("/health").status_code == 200
