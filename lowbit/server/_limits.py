"""Bounds on what a client may send: a request body's size, and how long its body may take.

`BodyLimit` wraps the app. A ``Content-Length`` over the limit is refused before a byte of the
body is read; a body without one (chunked) is counted as it arrives and refused as soon as it
passes the limit, so at most the limit (plus uvicorn's 64 KiB read buffer) is ever held. The
whole body must arrive within the read timeout of the request's head, else the client gets a
408 and the connection closes. Only then does the app see the request, so a slow client never
reaches the scheduler and holds no slot. Both refusals close the connection: the rest of an
unwanted body is never read. (The head's own deadline is uvicorn's side: see `_run`.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from lowbit.server._protocol import APIError

# The default `max_body_bytes`: a prompt filling a 32k-token context, as text or as token ids,
# takes a few hundred KB of JSON.
MAX_BODY_BYTES = 1 << 20
# The default `read_timeout`, seconds.
READ_TIMEOUT = 30.0


class _TooLarge(Exception):
    pass


def too_large(limit: int) -> APIError:
    """The 413 for a body over `limit` bytes."""
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes; send a "
        "smaller body, or start the server with a larger `lowbit serve --max-body-bytes`",
        code="request_too_large",
    )


def too_slow(seconds: float) -> APIError:
    """The 408 for a body that did not arrive within `seconds`."""
    return APIError(
        408,
        f"the request body did not arrive within {seconds:g} s of its headers; send it at "
        "once, or start the server with a longer `lowbit serve --read-timeout`",
        code="request_timeout",
    )


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses these before the app sees them
                return None
    return None


class BodyLimit:
    """ASGI middleware: reads each HTTP request's whole body, bounded in size and time, before
    the wrapped app sees the request (see the module docstring).

    Args:
      app: the ASGI app to wrap.
      max_bytes: the largest body accepted; larger ones get a 413.
      timeout: seconds the body may take from the request's head to its last byte; slower
        ones get a 408.
      on_refused: called with ``(path, status)`` for every request refused here.
    """

    def __init__(
        self,
        app: Callable,
        max_bytes: int,
        timeout: float,
        on_refused: Callable[[str, int], None] | None = None,
    ):
        if max_bytes < 1 or not timeout > 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1 and timeout={timeout} > 0")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, send, too_large(self.max_bytes))
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            await self._refuse(scope, send, too_slow(self.timeout))
            return
        except _TooLarge:
            await self._refuse(scope, send, too_large(self.max_bytes))
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, whenever it comes

        await self.app(scope, replay, send)

    async def _read(self, receive: Callable) -> bytes | None:
        """The whole body, or None if the client disconnected first."""
        parts = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                raise _TooLarge
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, scope: dict[str, Any], send: Callable, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""), err.status)
        content = json.dumps(err.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            # The rest of the body is not read: the connection cannot carry another request.
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
