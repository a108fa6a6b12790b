"""``homepd serve``'s edges over real HTTP (fake backend, no API key): bounded requests, strict types, lone
surrogates, cut error messages, the Host check, HEAD /health, the header-read timeout and the connection cap
under a small file-descriptor limit."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from test_serve_harness import ServeProcess
from homepd.osutil import die_with_parent

MODEL = "smollm2-135m-instruct-q4_1"
MAX_PROMPT_BYTES = 4096
MAX_MESSAGES = 64
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("edges")
    proc = ServeProcess(home, "--backend", "fake", "--n-ctx", "512",
                        "--max-prompt-bytes", str(MAX_PROMPT_BYTES), "--max-messages", str(MAX_MESSAGES),
                        "--header-timeout", str(HEADER_TIMEOUT_S), "--step-log", str(home / "steps.jsonl"),
                        api_key=None)
    proc.step_log = home / "steps.jsonl"
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def post_raw(client: httpx.Client, path: str, body: bytes | str) -> httpx.Response:
    return client.post(path, content=body.encode() if isinstance(body, str) else body,
                       headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("temperature", "0.5"), ("stream", "yes"),
                                         ("top_k", 2.5), ("seed", "1")])
def test_wrong_types_are_400_not_coerced(client, field, value):
    error = error_of(client.post("/v1/chat/completions", json=chat(**{field: value})), 400)
    assert error["param"] == field and error["code"] == "invalid_value", error


def test_the_step_log_has_a_line_for_every_step_of_a_request(server, client):
    before = server.step_log.read_text().splitlines()   # the warm-up's steps, at least
    reply = client.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    rows = [json.loads(line) for line in server.step_log.read_text().splitlines()[len(before):]]
    assert before and sum(r["n_decode_tokens"] for r in rows) >= 3 and any(r["n_prompt_tokens"] for r in rows)
    assert all(r["model"] == MODEL and r["duration_ms"] >= 0 and r["worker"] for r in rows)
    assert len({r["index"] for r in rows}) == len(rows)


def test_an_integer_is_still_a_valid_float(client):
    assert client.post("/v1/chat/completions", json=chat(temperature=0, top_p=1)).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL,
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\udc00"}]}]}' % MODEL, "messages.0.content.0.text"),
    ("/v1/completions", '{"model": "%s", "prompt": "x\\ud83d"}' % MODEL, "prompt"),
    ("/v1/completions", '{"model": "m\\ud83d", "prompt": "x"}', "model"),
])
def test_a_lone_surrogate_is_400_naming_the_field(server, client, path, body, param):
    error = error_of(post_raw(client, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert "Traceback" not in server.log()


def test_an_oversized_chunked_body_is_413(client):
    def chunks():  # no Content-Length: httpx sends it chunked
        yield b'{"model": "x", "prompt": "'
        for _ in range(100):
            yield b"y" * 4096
        yield b'"}'

    error = error_of(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                     413)
    assert error["code"] == "request_too_large", error


def test_too_many_messages_is_413_and_empty_messages_count_toward_the_prompt_bytes(client):
    many = chat(messages=[{"role": "user"}] * (MAX_MESSAGES + 1))
    assert error_of(client.post("/v1/chat/completions", json=many), 413)["code"] == "too_many_messages"
    # 64 empty messages hold no text, but their markup counts: 64 x 16 bytes + 4000 bytes > 4096
    heavy = chat(messages=[{"role": "user"}] * (MAX_MESSAGES - 1) + [{"role": "user", "content": "x" * 4000}])
    assert error_of(client.post("/v1/chat/completions", json=heavy), 413)["code"] == "prompt_too_large"


def test_a_body_of_too_many_json_values_is_413_before_it_is_parsed(client):
    body = json.dumps(chat(messages=[{"role": "user"}] * 4500))  # 81 kB: under the body bound (90 kB here)
    started = time.monotonic()
    error = error_of(post_raw(client, "/v1/chat/completions", body), 413)
    assert error["code"] == "request_too_large" and "JSON values" in error["message"], error
    assert time.monotonic() - started < 5.0  # refused, not parsed and rendered


def test_error_messages_cut_what_they_quote(client):
    response = client.post("/v1/chat/completions", json=chat(stop=["s" * 80_000]))  # under this body bound
    error = error_of(response, 400)
    assert error["param"].startswith("stop") and len(response.content) < 2000, len(response.content)


@pytest.mark.parametrize("host,status", [("evil.example", 403), ("evil.example:8439", 403), ("localhost", 200),
                                         ("127.0.0.1:1", 200), ("[::1]:8439", 200)])
def test_without_a_key_only_loopback_host_names_are_answered(server, host, status):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        response = c.get("/v1/models", headers={"Host": host})
    assert response.status_code == status, response.text
    if status == 403:
        assert response.json()["error"]["code"] == "host_not_allowed"


def test_allowed_hosts_are_answered_without_a_key(tmp_path):
    proc = ServeProcess(tmp_path, "--backend", "fake", "--allowed-hosts", "homepd.lan", api_key=None)
    try:
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=10) as c:
            assert c.get("/v1/models", headers={"Host": "homepd.lan:8439"}).status_code == 200
            assert c.get("/v1/models", headers={"Host": "other.lan"}).status_code == 403
    finally:
        assert proc.terminate() == 0, proc.log()


def test_head_health_is_200(client):
    response = client.head("/health")
    assert response.status_code == 200 and response.content == b""


def test_an_api_key_of_spaces_is_refused_at_start_up(tmp_path):
    done = subprocess.run([sys.executable, "-m", "homepd", "serve", "--backend", "fake", "--port", "1"],
                          env={"HOMEPD_API_KEY": " " * 12, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path),
                               "XDG_CONFIG_HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60, preexec_fn=die_with_parent)
    assert done.returncode != 0 and "API key" in done.stderr, done.stderr


def _partial_header_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
    return sock


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    sock = _partial_header_socket(server.port)
    started = time.monotonic()
    with sock:
        assert sock.recv(1024) == b""  # the server closed it (recv blocks until then; 30 s socket timeout)
    assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - started < HEADER_TIMEOUT_S + 10


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (headers and body may come in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_a_kept_alive_connection_gets_the_header_timeout_again(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 200 OK")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # the second request stalls
        assert sock.recv(4096) == b""


def test_partial_header_sockets_beyond_the_fd_limit_do_not_stop_the_service(tmp_path):
    """The issue's attack, scaled: 300 stalled sockets against a 256-descriptor limit.  Without a header
    timeout and a connection cap the service stops answering (accept fails with EMFILE) and logs a storm."""
    proc = ServeProcess(tmp_path, "--backend", "fake", "--header-timeout", "2", api_key=None,
                        wrapper=("prlimit", "--nofile=256:256", "--"))
    socks = []
    try:
        proc.wait_ready()
        for _ in range(300):
            try:
                socks.append(_partial_header_socket(proc.port))
            except OSError:  # refused while the server's cap is reached: what a client may see
                pass
        started = time.monotonic()
        with httpx.Client(base_url=proc.url, timeout=5) as c:
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - started < 20, "the service did not answer again"
                time.sleep(0.1)  # polling /health: the signal itself
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200
        assert proc.log_path.stat().st_size < 100_000, proc.log()[-3000:]
    finally:
        for sock in socks:
            sock.close()
        assert proc.terminate() == 0, proc.log()
