"""The connection guard and the request-shape errors without a server: which connection the cap closes, the
cap following the descriptor limit, the phase of a connection and its deadline on uvicorn's h11 protocol
(a fake transport, no socket), repeated headers, a body not sent as JSON, and JSON nested too deeply."""
from __future__ import annotations

import asyncio
import errno
import json

import pytest
import uvicorn
from starlette.exceptions import HTTPException

from homepd.errors import ConfigError
from homepd.serve.connections import FDS_RESERVED, ConnectionGuard, Phase, follow_fd_limit_on_accept_errors, \
    guarded_protocol
from homepd.serve.errors import APIError, content_type_error, from_http_exception, is_json_media_type
from homepd.serve.middleware import fold_repeated_headers
from homepd.serve.openai_routes import CLASS_HEADER, request_class
from homepd.serve.settings import ServeSettings


class Conn:
    def __init__(self, name: str):
        self.name, self.closed_why = name, None

    def close_slow(self, why: str) -> None:
        self.closed_why = why

    def __repr__(self) -> str:
        return self.name


def guard_of(cap: int, fd_limit: list[int] | None = None) -> ConnectionGuard:
    limit = fd_limit or [cap + FDS_RESERVED]
    return ConnectionGuard(max_connections=1000, read_fd_limit=lambda: limit[0])


def test_at_the_cap_the_connection_sending_its_request_the_longest_makes_room():
    guard = guard_of(cap=3)
    a, b, c, d = (Conn(n) for n in "abcd")
    assert all(guard.admit(conn) for conn in (a, b, c))
    guard.moved(a, Phase.BODY)  # still sending: keeps its place
    assert guard.admit(d)
    assert a.closed_why is not None and "connection cap" in a.closed_why
    assert (b.closed_why, c.closed_why, guard.n_open) == (None, None, 3)


def test_a_connection_being_served_is_never_closed_and_with_none_slow_the_new_one_is_refused():
    guard = guard_of(cap=2)
    a, b, c = (Conn(n) for n in "abc")
    guard.admit(a), guard.admit(b)
    guard.moved(a, Phase.SERVING)
    guard.moved(b, Phase.SERVING)
    assert not guard.admit(c)
    assert (a.closed_why, b.closed_why, guard.n_refused, guard.n_open) == (None, None, 1, 2)


def test_a_connection_slow_again_after_its_response_goes_last():
    guard = guard_of(cap=3)
    a, b, c, d = (Conn(n) for n in "abcd")
    for conn in (a, b, c):
        guard.admit(conn)
    guard.moved(a, Phase.SERVING)
    guard.moved(a, Phase.HEADERS)  # answered; now it waits for its next request, the latest to
    guard.admit(d)
    assert b.closed_why is not None and a.closed_why is None


def test_a_closed_connection_frees_its_place():
    guard = guard_of(cap=1)
    a, b = Conn("a"), Conn("b")
    guard.admit(a)
    guard.closed(a)
    assert guard.admit(b) and a.closed_why is None and guard.n_open == 1


def test_the_cap_follows_the_descriptor_limit_and_sheds_slow_connections_above_it():
    fd_limit = [FDS_RESERVED + 4]
    guard = guard_of(cap=4, fd_limit=fd_limit)
    conns = [Conn(str(i)) for i in range(4)]
    for conn in conns:
        guard.admit(conn)
    guard.moved(conns[0], Phase.SERVING)
    fd_limit[0] = FDS_RESERVED + 2  # prlimit --pid on the running service
    assert guard.follow_fd_limit() == 2
    assert [conn.closed_why is not None for conn in conns] == [False, True, True, False]
    fd_limit[0] = 65536
    assert guard.follow_fd_limit() == 1000  # raised again: up to --max-connections


def test_accept_out_of_descriptors_rereads_the_limit_and_is_still_reported():
    fd_limit = [FDS_RESERVED + 10]
    guard = guard_of(cap=10, fd_limit=fd_limit)
    loop = asyncio.new_event_loop()
    reported = []
    loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
    try:
        follow_fd_limit_on_accept_errors(loop, guard)
        fd_limit[0] = FDS_RESERVED + 3
        loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                     "exception": OSError(errno.EMFILE, "Too many open files")})
        assert guard.cap == 3 and reported == ["socket.accept() out of system resource"]
    finally:
        loop.close()


class FakeTransport:
    def __init__(self):
        self.written, self.closing = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8439), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def closed(transport: FakeTransport, timeout_s: float = 5.0) -> None:
    """Poll until the protocol closes ``transport`` (its deadline's timer does)."""
    async with asyncio.timeout(timeout_s):
        while not transport.is_closing():
            await asyncio.sleep(0.005)


async def waiting_app(scope, receive, send):  # reads the body, as the body bound does
    while (await receive()).get("more_body"):
        pass


def protocol(guard: ConnectionGuard, body_timeout_s: float = 30.0):
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(waiting_app, lifespan="off")
    proto = guarded_protocol(guard, 30.0, body_timeout_s)(config, uvicorn.server.ServerState(), {}, _loop=loop)
    proto.connection_made(FakeTransport())
    return proto


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10\r\n"


def test_a_connection_moves_through_headers_body_and_serving_as_its_request_arrives():
    async def run():
        guard = guard_of(cap=10)
        proto = protocol(guard)
        assert proto.phase is Phase.HEADERS and guard.n_slow == 1
        proto.data_received(HEAD)
        assert proto.phase is Phase.HEADERS
        proto.data_received(b"\r\n{\"a\":")
        assert proto.phase is Phase.BODY and guard.n_slow == 1
        proto.data_received(b" 100}")
        assert proto.phase is Phase.SERVING and guard.n_slow == 0
        proto.connection_lost(None)
        assert guard.n_open == 0
        await asyncio.gather(*proto.tasks)

    asyncio.run(run())


def test_a_body_past_its_deadline_is_answered_408_in_openai_shape_and_closed():
    async def run():
        proto = protocol(guard_of(cap=10), body_timeout_s=0.01)
        proto.data_received(HEAD + b"\r\n{")
        transport = proto.transport
        await closed(transport)
        head, _, body = transport.written.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
        assert proto.cycle.disconnected  # what the app sends now is dropped
        proto.connection_lost(None)
        await asyncio.gather(*proto.tasks)

    asyncio.run(run())


def test_a_body_still_arriving_when_the_cap_needs_its_place_is_answered_408_and_closed():
    async def run():
        guard = guard_of(cap=1)
        slow = protocol(guard)
        slow.data_received(HEAD + b"\r\n{")
        new = protocol(guard)
        assert slow.transport.is_closing() and not new.transport.is_closing()
        head, _, body = slow.transport.written.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and "connection cap" in json.loads(body)["error"]["message"]
        slow.connection_lost(None)
        new.connection_lost(None)
        await asyncio.gather(*slow.tasks)

    asyncio.run(run())


def test_headers_that_do_not_arrive_in_time_close_the_connection_without_an_answer():
    async def run():
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(waiting_app, lifespan="off")
        proto = guarded_protocol(guard_of(cap=10), 0.01, 30.0)(config, uvicorn.server.ServerState(), {}, _loop=loop)
        proto.connection_made(FakeTransport())
        proto.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await closed(proto.transport)
        assert proto.transport.written == b""
        proto.connection_lost(None)

    asyncio.run(run())


def test_repeated_headers_are_folded_into_one_comma_separated_value():
    headers = [(b"host", b"x"), (b"x-homepd-class", b"background"), (b"accept", b"*/*"),
               (b"x-homepd-class", b"interactive")]
    assert fold_repeated_headers(headers) == [(b"host", b"x"), (b"x-homepd-class", b"background, interactive"),
                                              (b"accept", b"*/*")]
    single = [(b"host", b"x")]
    assert fold_repeated_headers(single) is single


def test_a_class_header_with_two_different_values_is_400_naming_it():
    with pytest.raises(APIError) as raised:
        request_class(None, "background, interactive")
    assert raised.value.param == CLASS_HEADER and CLASS_HEADER in raised.value.message
    assert request_class(None, "background, Background") == "background"


@pytest.mark.parametrize("content_type,is_json", [("application/json", True), ("Application/JSON; charset=utf-8", True),
                                                  ("application/vnd.api+json", True), ("text/plain", False),
                                                  ("application/x-www-form-urlencoded", False), (None, False)])
def test_json_media_types(content_type, is_json):
    assert is_json_media_type(content_type) is is_json


def test_a_body_not_sent_as_json_says_to_send_the_content_type():
    not_an_object = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
    error = content_type_error("text/plain", not_an_object)
    assert error.code == "invalid_content_type" and "Content-Type: application/json" in error.message
    assert "no Content-Type" in content_type_error(None, not_an_object).message
    assert content_type_error("application/json", not_an_object) is None  # JSON, just not an object
    assert content_type_error(None, [{"type": "missing", "loc": ("body", "model")}]) is None


def test_a_body_the_framework_cannot_parse_has_a_code():
    def raised_from(cause):
        exc = HTTPException(400, "There was an error parsing the body")
        exc.__cause__ = cause
        return from_http_exception(exc)

    deep = raised_from(RecursionError("maximum recursion depth exceeded while decoding a JSON array"))
    assert deep.code == "invalid_json" and "nested" in deep.message
    assert raised_from(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")).code == "invalid_json"
    assert from_http_exception(HTTPException(404, "Not Found")).code == "not_found"
    assert from_http_exception(HTTPException(405, "Method Not Allowed")).code == "method_not_allowed"


def test_a_body_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="body_timeout_s"):
        ServeSettings(body_timeout_s=0).validated()
