"""ASGI middleware: the Host check, the API key (every route but /health) and the request bound.

The key is compared in constant time (``secrets.compare_digest``) so its
content cannot be guessed from response times.  Without a key, only loopback
Host names (and ``--allowed-hosts``) are answered, so that a web page cannot
reach the loopback service through DNS rebinding.  The body bound reads the
whole body before the app sees it: over ``max_body_bytes`` (declared, or
chunked and counted) it is 413, and so is a JSON body with more values than
``max_json_values`` — counted off the loop before JSON is parsed on it, since
parsing holds the event loop for about a second per million values.  The
request bound also folds a header sent more than once into one
comma-separated value (RFC 9110 5.3), so that a route, which reads one value,
sees them all and can refuse two that differ.  (How long the body may take
to arrive is the connection's deadline: ``homepd.serve.connections``.)
"""
from __future__ import annotations

import asyncio
import secrets

from homepd.serve.errors import AUTHENTICATION, APIError
from homepd.serve.settings import is_loopback

OPEN_PATHS = frozenset({"/health"})
JSON_COUNT_FROM_BYTES = 64 << 10  # smaller bodies cannot hold enough values to matter


class HostCheckMiddleware:
    """Refuse (403) a request whose Host header names neither a loopback address nor an allowed host."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.allowed = app, frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        name = host_name(host.decode("latin-1")) if host is not None else None
        if name is None or is_loopback(name) or name in self.allowed:
            return await self.app(scope, receive, send)
        await APIError(403, f"Host {cut(name)!r} is not served: without an API key homepd answers only loopback "
                            "names; add the name to --allowed-hosts (HOMEPD_ALLOWED_HOSTS) to allow it",
                       "permission_error", "host_not_allowed").response()(scope, receive, send)


def host_name(host: str) -> str:
    """The name in a Host header, without the port ('[::1]:8439' -> '::1'), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def cut(text: str, n_chars: int = 64) -> str:
    """``text`` for quoting in an error message: at most ``n_chars``, and nothing that cannot be encoded."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= n_chars else text[:n_chars] + f"... ({len(text)} characters)"


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._is_authorized(scope):
            return await self.app(scope, receive, send)
        error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the key is the "
                              "service's HOMEPD_API_KEY)", AUTHENTICATION, "invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _is_authorized(self, scope) -> bool:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


def count_json_values(body: bytes, stop_above: int) -> int:
    """An upper bound on the values in a JSON text (commas, objects and arrays outside strings), counted up
    to just over ``stop_above``.  Pure Python over the string boundaries, so that in a thread it yields the
    GIL to the event loop."""
    n, start, inside = 0, 0, False
    while n <= stop_above:
        quote = body.find(b'"', start)
        end = len(body) if quote < 0 else quote
        if not inside:
            n += body.count(b",", start, end) + body.count(b"{", start, end) + body.count(b"[", start, end)
        if quote < 0:
            break
        if inside and (end - start - len(body[start:end].rstrip(b"\\"))) % 2:  # an escaped quote
            start = end + 1
            continue
        inside, start = not inside, quote + 1
    return n


def fold_repeated_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with the lines of a repeated name joined into one, comma-separated, where its first was;
    the same list when no name repeats."""
    names = {name for name, _ in headers}
    if len(names) == len(headers):
        return headers
    values: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        values.setdefault(name, []).append(value)
    return [(name, b", ".join(vs)) for name, vs in values.items()]


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int, max_json_values: int):
        self.app, self.max_body_bytes, self.max_json_values = app, max_body_bytes, max_json_values

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = fold_repeated_headers(scope["headers"])
        if headers is not scope["headers"]:
            scope = {**scope, "headers": headers}
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._refuse(scope, receive, send, f"request body over {self.max_body_bytes} bytes")
        # why: read it all here, so that a chunked body over the bound is a 413 too (inside the app, the
        # framework turns an error while reading into a 400)
        chunks, n_bytes, first = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client left before sending it all
                break
            chunks.append(message.get("body", b""))
            n_bytes += len(chunks[-1])
            if n_bytes > self.max_body_bytes:
                return await self._refuse(scope, receive, send, f"request body over {self.max_body_bytes} bytes")
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) > JSON_COUNT_FROM_BYTES and (body.count(b",") + body.count(b"{") + body.count(b"[") > self.max_json_values) \
                and await asyncio.to_thread(count_json_values, body, self.max_json_values) > self.max_json_values:
            return await self._refuse(scope, receive, send, f"request body holds more than {self.max_json_values} "
                                                            "JSON values (--max-messages bounds them)")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, message: str):
        await APIError(413, message, code="request_too_large",
                       headers={"Connection": "close"}).response()(scope, receive, send)
