"""Running the app on uvicorn, with a graceful SIGTERM: stop accepting, let running requests
finish within a grace period, stop the scheduler, return (the process then exits 0)."""

from __future__ import annotations

import signal
from typing import Any

import uvicorn

from lowbit.server._app import ServedModel, create_app


def _ignore(signum: int, frame: Any) -> None:
    pass


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
    app = create_app(served)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=grace,
        access_log=False,
    )
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
