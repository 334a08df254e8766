"""HTTP/1.1 over raw sockets for the soak (`_soak_driver`): requests as bytes, responses read
as they arrive (heads, bodies, chunks, server-sent events), and connections closed with a FIN
or a reset, so that a client can also misbehave as no HTTP library would."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import struct
from collections.abc import AsyncIterator

HOST = "127.0.0.1"


class NoAnswer(Exception):
    """The connection ended before a complete answer."""


def request_bytes(
    path: bytes | str,
    body: bytes = b"",
    *,
    method: str = "POST",
    length: int | None = None,
    chunked: bool = False,
) -> bytes:
    """A request head (and `body`, unless `chunked`: the caller sends the chunks)."""
    target = path.encode() if isinstance(path, str) else path
    head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
    head.append(b"Connection: close")
    if method == "POST":
        head.append(b"Content-Type: application/json")
        if chunked:
            head.append(b"Transfer-Encoding: chunked")
        else:
            head.append(b"Content-Length: %d" % (len(body) if length is None else length))
    return b"\r\n".join(head) + b"\r\n\r\n" + (b"" if chunked else body)


async def connect(
    port: int, receive_buffer: int | None = None, limit: int = 1 << 16
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connecting: it sets the advertised window
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=limit)


def close_connection(writer: asyncio.StreamWriter, reset: bool = False) -> None:
    if reset:  # SO_LINGER 0: the close sends a reset, not a FIN
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        raise NoAnswer(f"closed before an answer ({len(err.partial)} bytes)") from None
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked body, as they arrive."""
    try:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            yield (await reader.readexactly(size + 2))[:-2]
    except asyncio.IncompleteReadError:
        raise NoAnswer("closed inside a chunked body") from None


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    try:
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return b"".join([piece async for piece in read_chunks(reader)])
        return await reader.read()
    except asyncio.IncompleteReadError:
        raise NoAnswer("closed inside the body") from None


async def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(10):
        reader, writer = await connect(port)
        try:
            writer.write(request_bytes(path, method="GET"))
            await writer.drain()
            status, headers = await read_head(reader)
            return status, headers, await read_body(reader, headers)
        finally:
            close_connection(writer)


# -- the requests -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Answer:
    """A completion's token ids, text and finish reason."""

    ids: tuple[int, ...]
    text: str
    finish: str | None


def completion_body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    return json.dumps(body).encode()


def read_whole(data: bytes) -> Answer:
    choice = json.loads(data)["choices"][0]
    return Answer(tuple(choice["token_ids"]), choice["text"], choice["finish_reason"])


async def read_events(
    reader: asyncio.StreamReader, pause: float = 0.0, rng: random.Random | None = None
) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream (pausing `pause` seconds, at
    random up to it, after each piece of the body)."""
    pending = b""
    async for piece in read_chunks(reader):
        pending += piece
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data: "):
                    yield line[6:]
        if pause and rng is not None:
            await asyncio.sleep(rng.uniform(0, pause))


async def read_streamed(
    reader: asyncio.StreamReader, pause: float = 0.0, rng: random.Random | None = None
) -> Answer:
    ids: list[int] = []
    text: list[str] = []
    finish = None
    done = False
    async for data in read_events(reader, pause, rng):
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            raise NoAnswer(f"the stream ended with an error: {event['error']}")
        choice = event["choices"][0]
        ids += choice.get("token_ids", [])
        text.append(choice["text"])
        finish = choice["finish_reason"] or finish
    if not done:
        raise NoAnswer("the stream ended without [DONE]")
    return Answer(tuple(ids), "".join(text), finish)
