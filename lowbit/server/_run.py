"""Running the app on uvicorn, with a graceful SIGTERM: stop accepting, let running requests
finish within a grace period, stop the scheduler, return (the process then exits 0).

Connections are bounded on uvicorn's side. A request's head (its request line and headers)
still incomplete after 16 KiB gets a 400 (h11's bound on what it buffers). The head must arrive
within the served model's `read_timeout` of the connection opening or of the previous answer,
else the connection is closed: uvicorn has no such deadline of its own, and a client that sent
half a head and stalled would keep its connection forever. The body's bounds are the app's
(`BodyLimit`).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lowbit.server._app import ServedModel, create_app

# The most of an incomplete request head h11 buffers (its own default, set here to be on record).
MAX_HEAD_BYTES = 16 * 1024


def _ignore(signum: int, frame: Any) -> None:
    pass


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head has not arrived
    `head_timeout` seconds after it opened or after the previous answer."""

    head_timeout: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        # IDLE: h11 is still waiting for the head (a request that came whole is never cut).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # a keep-alive connection: the next head has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace: float = 30.0,
    log_level: str = "info",
) -> uvicorn.Config:
    """The uvicorn configuration serving `served`: its app, and the connection bounds of the
    module docstring."""
    protocol = type("HeadDeadline", (_HeadDeadline,), {"head_timeout": served.read_timeout})
    return uvicorn.Config(
        create_app(served),
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=grace,
        access_log=False,
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )


def run(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serves until SIGTERM or SIGINT, then drains (see the module docstring).

    The scheduler compiles in the background meanwhile: ``/health`` answers 503 "loading"
    until it is ready.
    """
    config = uvicorn_config(served, host=host, port=port, grace=grace, log_level=log_level)
    server = uvicorn.Server(config)
    # uvicorn raises the signal it caught again once it has shut down; with these handlers in
    # place that second delivery is a no-op instead of the default (termination, status 143).
    previous = {s: signal.signal(s, _ignore) for s in (signal.SIGTERM, signal.SIGINT)}
    served.scheduler.start()
    try:
        server.run()
    finally:
        served.scheduler.close(timeout=grace)
        for s, handler in previous.items():
            signal.signal(s, handler)
