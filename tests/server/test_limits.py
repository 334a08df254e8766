"""Bounds on what a client sends: a body over the size limit gets a 413 (unread when its
Content-Length says so), and a client that sends its head or body too slowly is dropped after
the read timeout, never reaching a slot, while other clients are served meanwhile."""

import dataclasses
import json

import httpx
import pytest
from server_support import connect, read_to_close, running

LIMIT = 4096
# Short for the tests; generous enough for a loaded machine to send a small body in time.
READ_TIMEOUT = 2.0
# Longer than any wait the server may impose here: a recv that outlasts it is a failure.
SOCKET_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def limited(served, base_url):
    """A second app on the session's (running) scheduler, with small limits."""
    bounded = dataclasses.replace(served, max_body_bytes=LIMIT, read_timeout=READ_TIMEOUT)
    with running(bounded, start=False) as url:
        yield url


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _head(length: int | None = None, chunked: bool = False) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _completes(url: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=SOCKET_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _assert_too_large(status: int, error: dict) -> None:
    assert status == 413
    assert str(LIMIT) in error["message"] and "--max-body-bytes" in error["message"]
    assert error["code"] == "request_too_large"


def test_a_body_over_the_limit_gets_413_and_the_server_keeps_answering(limited):
    body = json.dumps({"prompt": "x" * LIMIT}).encode()
    with connect(limited, SOCKET_TIMEOUT) as sock:
        # Sent whole before reading: the server has read it all when it closes the connection,
        # so the close cannot turn into a reset that loses the answer.
        sock.sendall(_head(length=len(body)) + body)
        answer = read_to_close(sock)
    _assert_too_large(*_status_and_error(answer))
    assert b"connection: close" in answer.partition(b"\r\n\r\n")[0].lower()
    _completes(limited)
    metrics = httpx.get(f"{limited}/metrics").text
    assert 'lowbit_requests_total{endpoint="/v1/completions",status="413"}' in metrics


def test_a_chunked_body_is_counted_as_it_arrives(limited):
    chunk = b"x" * 1024
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(2 * LIMIT // 1024))
    with connect(limited, SOCKET_TIMEOUT) as sock:
        sock.sendall(_head(chunked=True) + chunks + b"0\r\n\r\n")
        _assert_too_large(*_status_and_error(read_to_close(sock)))
    _completes(limited)


def test_a_declared_length_over_the_limit_is_refused_unread(limited):
    with connect(limited, SOCKET_TIMEOUT) as sock:
        sock.sendall(_head(length=10**9))  # and never a byte of the body
        # Were the server waiting for the body, this would be a 408 after the read timeout.
        _assert_too_large(*_status_and_error(read_to_close(sock)))


def test_a_stalled_body_is_dropped_and_holds_no_slot(limited, served):
    scheduler = served.scheduler
    with connect(limited, SOCKET_TIMEOUT) as sock:
        sock.sendall(_head(length=100) + b'{"prompt": ')  # 11 of the 100 bytes, then nothing
        _completes(limited)  # served while the slow client stalls
        assert scheduler.queue_length == 0 and scheduler.busy_slots == 0
        status, error = _status_and_error(read_to_close(sock))
    assert status == 408
    assert "--read-timeout" in error["message"] and error["code"] == "request_timeout"
    _completes(limited)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: te"])
def test_a_stalled_head_is_dropped(limited, sent):
    with connect(limited, SOCKET_TIMEOUT) as sock:
        sock.sendall(sent)
        _completes(limited)  # served while the slow client stalls
        assert read_to_close(sock) == b""  # closed without an answer: there is no request
    _completes(limited)


def test_a_head_growing_past_16_kib_is_refused(limited):
    with connect(limited, SOCKET_TIMEOUT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * 20000)  # no end
        assert read_to_close(sock).startswith(b"HTTP/1.1 400")
