"""A tiny served model for the server tests: a random-weight GGUF decoder (a 260-token
byte-level vocabulary, 256-token context), a trivial chat template, and a uvicorn server on a
free loopback port in a background thread, configured as `lowbit serve` configures it."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn

from lowbit import server, serving
from lowbit.models._chat_template import ChatTemplate
from lowbit.server._run import uvicorn_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_gguf import write_tiny_gguf  # noqa: E402

ARCH = "llama3"
# role: content lines, then the assistant's turn.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Small enough to compile in seconds, large enough for a chunked prefill and a cache shift.
CONFIG = server.SchedulerConfig(
    slots=4, max_len=128, queue=64, single_pass=32, chunk=16, embeddings=True
)


def tiny_model(directory: Path) -> serving.LoadedModel:
    path = write_tiny_gguf(ARCH, directory / "tiny.gguf")
    return serving.load_model(str(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(url: str, timeout: float = 60.0) -> socket.socket:
    """A raw TCP connection to the server at `url` (for clients no HTTP library would be)."""
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends on `sock` until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def served_model(loaded, config=CONFIG, **options) -> server.ServedModel:
    from lowbit.cli._common import stop_ids

    scheduler = server.Scheduler(loaded.model, None, None, config)
    return server.ServedModel(
        name="tiny",
        tokenizer=loaded.tokenizer,
        chat_template=ChatTemplate(TEMPLATE),
        stop_ids=frozenset(stop_ids(loaded, None)),
        scheduler=scheduler,
        **options,
    )


@contextlib.contextmanager
def running(served: server.ServedModel, start: bool = True) -> Iterator[str]:
    """Serves `served` on a free loopback port; yields the base URL once it is ready and its
    background compile is done (so that the prefix cache reads and saves from the first
    request on). `start` False: its scheduler already runs (another app on the same model)."""
    port = free_port()
    config = uvicorn_config(served, host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    if start:
        served.scheduler.start()
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    scheduler = served.scheduler
    while not (uv.started and scheduler.ready and scheduler.programs.done.is_set()):
        if served.scheduler.error is not None:
            raise served.scheduler.error
        if time.monotonic() > deadline:
            raise TimeoutError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)
        if start:
            served.scheduler.close()
