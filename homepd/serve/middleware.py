"""ASGI middleware: the API key (every route but /health) and the request body bound.

The key is compared in constant time (``secrets.compare_digest``) so its
content cannot be guessed from response times.  The body bound refuses a
request whose ``Content-Length`` (or, chunked, whose bytes so far) exceeds it
with 413, before the JSON is parsed.
"""
from __future__ import annotations

import secrets

from homepd.serve.errors import AUTHENTICATION, APIError

OPEN_PATHS = frozenset({"/health"})


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


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise BodyTooLarge()
            return message

        try:
            await self.app(scope, bounded_receive, send)
        except BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        await APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large",
                       headers={"Connection": "close"}).response()(scope, receive, send)
