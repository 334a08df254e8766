"""A soak of `lowbit serve`: many concurrent clients, well-behaved and hostile, on loopback.

Every client is an asyncio task speaking HTTP/1.1 over its own raw socket (`_soak_http`: one
connection per request, ``Connection: close``), so that it can also misbehave as no HTTP
library would. The clients take items one at a time from one shuffled list, so the kinds of
request are spread over the whole run:

- ``plain`` / ``stream``: the well-behaved clients. A greedy completion, whole or as
  server-sent events, whose token ids and text must equal the reference answer for its prompt
  and ``max_tokens``; a 429 is retried after its ``Retry-After``. Their latency (first send to
  last byte, retries included) is what the p50 / p99 are taken over.
- ``slow``: a streamed greedy completion read by a client with a 2 KiB receive buffer that
  pauses between chunks; its answer is checked as well (and a 429 retried).
- ``disconnect``: a streamed completion abandoned after its first event (a FIN or a reset), or
  right after sending the request.
- ``too_large``: a body over ``--max-body-bytes``: declared by ``Content-Length`` and never sent
  (a 413), sent whole, or sent chunked (a 413, or a reset: the server does not read the rest).
- ``bad_utf8``: bytes that are not UTF-8 in a string, a truncated sequence, a lone surrogate
  escaped as JSON allows (in a prompt, in a chat message), a UTF-16 body, a request line that
  is not UTF-8: a 400.
- ``deep_json``: nesting far past Python's recursion limit, at the top and inside fields, and
  just under it in a field the server quotes back: a 400, never a 500.
- ``burst``: `Settings.burst` completions sent at once, so that the queue fills: each gets a 200
  (checked) or a 429, and no retry.

The references are computed first through the same server by one client, one request at a
time (the server answers a greedy request as `lowbit.generate_tokens` would; the test checks
that too on its model). Counted: answers with a status of 500 or more (of any kind), wrong
answers (a checked answer that differs, or a status its kind never expects), lost answers (a
checked request without a complete answer: a reset, a timeout, a truncated stream), and the
server's resident memory (``VmRSS``) sampled over time. After a phase the server must be alive,
``/health`` must answer 200, and its queue and slots must drain to empty.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._soak_http import (
    HOST,
    Answer,
    NoAnswer,
    close_connection,
    completion_body,
    connect,
    get,
    read_body,
    read_events,
    read_head,
    read_streamed,
    read_whole,
    request_bytes,
)

WELL_BEHAVED = ("plain", "stream")
# Kinds whose answers are compared with the references.
CHECKED = ("plain", "stream", "slow", "burst")
# Share of the requests of each kind (a burst item counts as `Settings.burst` requests).
MIX = {
    "plain": 0.34,
    "stream": 0.34,
    "slow": 0.05,
    "disconnect": 0.07,
    "too_large": 0.05,
    "bad_utf8": 0.05,
    "deep_json": 0.04,
    "burst": 0.06,
}
# Statuses each kind may get without that being a failure (None: no answer, e.g. a reset).
_EXPECTED: dict[str, tuple[int | None, ...]] = {
    "disconnect": (200, 429, None),
    "bad_utf8": (400,),
    "deep_json": (400,),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How big a soak is, and what the server it drives was started with.

    Attributes:
      clients: concurrent clients.
      requests: requests in the hostile phase (a burst counts as `burst` requests).
      baseline: requests in the phase of well-behaved clients only (0: none).
      max_tokens: the ``max_tokens`` values requests draw from.
      burst: requests a burst sends at once (more than the server's queue plus slots, less
        what the other clients keep in flight, to fill the queue).
      max_body_bytes: the server's ``--max-body-bytes``.
      rss_at: the request count at which the server's memory is read for the comparison with
        its memory at the end.
      timeout: seconds a request may take before it counts as lost.
      retries: 429s a well-behaved request retries before it counts as lost.
      seed: the shuffle and every random choice of the clients.
      progress: print the count of answered requests and the server's memory to stderr
        every 30 s.
    """

    clients: int = 64
    requests: int = 5000
    baseline: int = 1000
    max_tokens: tuple[int, ...] = (4, 8, 12)
    burst: int = 32
    max_body_bytes: int = 65536
    rss_at: int = 500
    timeout: float = 300.0
    retries: int = 60
    seed: int = 0
    progress: bool = False


@dataclasses.dataclass
class Outcome:
    """One request's fate."""

    kind: str
    variant: str
    status: int | None = None
    latency: float = 0.0
    retries: int = 0
    wrong: str | None = None  # what differs from the expected answer
    lost: str | None = None  # why no complete answer came


@dataclasses.dataclass(frozen=True)
class _Item:
    kind: str
    prompt: int
    max_tokens: int
    variant: int


# -- the server process -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """The resident set of process `pid`, MiB (NaN once it has gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def start_server(
    command: Sequence[str], port: int, log: Path, env: dict | None, cwd: Path, wait: float = 1800
) -> subprocess.Popen:
    """Starts `command` (a ``lowbit serve`` on `port`), output to `log`; returns once
    ``/health`` answers 200."""
    out = open(log, "w")
    proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    out.close()
    deadline = time.monotonic() + wait
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        if health(port) == 200:
            return proc
        if time.monotonic() > deadline:
            stop_server(proc)
            raise TimeoutError(f"the server was not ready in {wait:g} s: {log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, wait: float = 60) -> int:
    """SIGTERM, then SIGKILL after `wait` seconds; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def health(port: int) -> int | None:
    """The status of ``GET /health``, or None without an answer."""
    try:
        status, _, _ = asyncio.run(get(port, "/health"))
    except (OSError, NoAnswer, TimeoutError):
        return None
    return status


def server_log_errors(log: Path) -> list[str]:
    """Lines of the server's log that report an exception in the app (a traceback)."""
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if "Traceback" in line or "Exception in ASGI" in line]


class Soak:
    """Drives the server process `proc`, listening on `port`, with the prompts `prompts`."""

    def __init__(
        self, port: int, proc: subprocess.Popen, prompts: Sequence[str], settings: Settings
    ):
        self.port = port
        self.proc = proc
        self.pid = proc.pid
        self.prompts = list(prompts)
        self.settings = settings
        self.references: dict[tuple[int, int], Answer] = {}
        self.rng = random.Random(settings.seed)

    # -- references ---------------------------------------------------------------------------

    async def _references(self) -> None:
        for p in range(len(self.prompts)):
            for n in self.settings.max_tokens:
                status, answer = await self._generate(p, n, stream=False)
                if status != 200 or not isinstance(answer, Answer):
                    raise RuntimeError(f"the reference request ({p}, {n}) got {status}")
                self.references[p, n] = answer

    def compute_references(self) -> dict[tuple[int, int], Answer]:
        """The greedy answer to every (prompt, max_tokens), one request at a time."""
        asyncio.run(self._references())
        return self.references

    # -- one request of each kind -------------------------------------------------------------

    async def _generate(
        self,
        prompt: int,
        max_tokens: int,
        stream: bool,
        receive_buffer: int | None = None,
        pause: float = 0.0,
    ) -> tuple[int, Answer | float | None]:
        """The status and the answer (a 200), the seconds its ``Retry-After`` says (a 429), or
        None (another status)."""
        body = completion_body(self.prompts[prompt], max_tokens, stream)
        limit = 1 << 16 if receive_buffer is None else 1024
        reader, writer = await connect(self.port, receive_buffer, limit)
        try:
            writer.write(request_bytes("/v1/completions", body))
            await writer.drain()
            status, headers = await read_head(reader)
            if status != 200:
                await read_body(reader, headers)
                if status != 429:
                    return status, None
                if "retry-after" not in headers:
                    raise NoAnswer("a 429 without Retry-After")
                return status, float(headers["retry-after"])
            if stream:
                return status, await read_streamed(reader, pause, self.rng)
            return status, read_whole(await read_body(reader, headers))
        finally:
            close_connection(writer)

    def _check(self, out: Outcome, item: _Item, answer: Answer) -> None:
        want = self.references[item.prompt, item.max_tokens]
        if answer != want:
            out.wrong = (
                f"prompt {item.prompt}, max_tokens {item.max_tokens}: got {answer}, expected {want}"
            )

    async def _checked(self, item: _Item, out: Outcome, retry: bool) -> None:
        """A completion whose answer must equal the reference (`retry`: after 429s)."""
        stream = item.kind == "stream" or (item.kind == "burst" and item.variant % 2 == 1)
        slow = item.kind == "slow"
        start = time.perf_counter()
        try:
            while True:
                status, answer = await self._generate(
                    item.prompt,
                    item.max_tokens,
                    stream or slow,
                    receive_buffer=2048 if slow else None,
                    pause=0.1 if slow else 0.0,
                )
                out.status = status
                if status == 429 and retry and out.retries < self.settings.retries:
                    out.retries += 1
                    await asyncio.sleep(answer)  # as the server's Retry-After says
                    continue
                break
        except (NoAnswer, OSError) as err:
            out.lost = f"{type(err).__name__}: {err}"
            return
        out.latency = time.perf_counter() - start
        if status == 429 and retry:
            out.lost = f"still 429 after {out.retries} retries"
        elif status == 429 and item.kind == "burst":
            pass
        elif status != 200 or not isinstance(answer, Answer):
            out.wrong = f"status {status}"
        else:
            self._check(out, item, answer)

    async def _disconnect(self, item: _Item, out: Outcome) -> None:
        body = completion_body(self.prompts[item.prompt], item.max_tokens, stream=True)
        reader, writer = await connect(self.port)
        mode = item.variant % 3  # 0: FIN after the first event, 1: reset, 2: before any answer
        try:
            writer.write(request_bytes("/v1/completions", body))
            await writer.drain()
            if mode == 2:
                return
            out.status, headers = await read_head(reader)
            if out.status == 200:
                async for _ in read_events(reader):
                    break
            else:
                await read_body(reader, headers)
        except (NoAnswer, OSError):
            pass  # the stream may end first (a short answer); nothing is owed to this client
        finally:
            close_connection(writer, reset=mode == 1)

    async def _too_large(self, item: _Item, out: Outcome) -> None:
        limit = self.settings.max_body_bytes
        mode = item.variant % 3  # 0: declared and never sent, 1: sent whole, 2: chunked
        over = limit + 1 + self.rng.randrange(4096)
        body = b'{"prompt": "' + b"x" * (over - 14) + b'"}'
        reader, writer = await connect(self.port)
        out.variant = ("declared", "whole", "chunked")[mode]
        try:
            try:
                if mode == 0:
                    writer.write(request_bytes("/v1/completions", length=over))
                elif mode == 1:
                    writer.write(request_bytes("/v1/completions", body))
                else:
                    writer.write(request_bytes("/v1/completions", chunked=True))
                    for at in range(0, len(body), 4096):
                        piece = body[at : at + 4096]
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
            except OSError:
                pass  # refused before it was all sent: the answer may still be there to read
            out.status, headers = await read_head(reader)
            await read_body(reader, headers)
        except (NoAnswer, OSError) as err:
            if mode == 0:  # nothing unread: the 413 must arrive
                out.wrong = f"no answer: {type(err).__name__}: {err}"
            return
        finally:
            close_connection(writer)
        if out.status != 413:
            out.wrong = f"status {out.status}, expected 413"

    def _bad_utf8(self, item: _Item) -> tuple[str, bytes]:
        prompt = self.prompts[item.prompt].encode()
        bodies = [
            ("latin-1", b'{"prompt": "caf\xe9 ' + prompt + b'", "max_tokens": 2}'),
            ("truncated", b'{"prompt": "' + prompt + b'\xe2\x82", "max_tokens": 2}'),
            ("surrogate", b'{"prompt": "' + prompt + b'\\ud800", "max_tokens": 2}'),
            ("utf-16", json.dumps({"prompt": self.prompts[item.prompt]}).encode("utf-16")),
            ("ff-bytes", b"\xff\xfe\xfd" + prompt),
        ]
        return bodies[item.variant % len(bodies)]

    def _deep_json(self, item: _Item) -> tuple[str, bytes]:
        # Deeper than Python's recursion limit (1,000), yet under the body limit.
        room = self.settings.max_body_bytes - 100
        lists, objects = min(20000, room // 2), min(10000, room // 7)
        if min(lists, objects) <= 1000:
            raise ValueError(f"max_body_bytes={self.settings.max_body_bytes} leaves no room")
        deep_object = b'{"a":' * objects + b"1" + b"}" * objects
        bodies = [
            ("top-level", b"[" * min(50000, room)),
            ("prompt", b'{"prompt": ' + b"[" * lists + b"]" * lists + b"}"),
            ("objects", b'{"prompt": "x", "a": ' + deep_object + b"}"),
            # Just under the parser's limit, in a field whose value the error message quotes.
            ("quoted", b'{"prompt": "x", "logprobs": ' + b"[" * 900 + b"]" * 900 + b"}"),
        ]  # fmt: skip
        return bodies[item.variant % len(bodies)]

    async def _refused(self, item: _Item, out: Outcome, variant: str, body: bytes) -> None:
        """A body the server must answer with a 4xx of the kind's (`_EXPECTED`)."""
        out.variant = variant
        path: bytes = b"/v1/completions"
        if variant == "surrogate" and item.variant % 2:
            path = b"/v1/chat/completions"
            body = b'{"messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 2}'
        request = request_bytes(path, body)
        if variant == "ff-bytes":  # the request line itself is not UTF-8
            request = request_bytes(b"/v1/compl\xff\xfeetions", b'{"prompt": "x"}')
        reader, writer = await connect(self.port)
        try:
            writer.write(request)
            await writer.drain()
            out.status, headers = await read_head(reader)
            await read_body(reader, headers)
        except (NoAnswer, OSError) as err:
            out.wrong = f"no answer: {type(err).__name__}: {err}"
            return
        finally:
            close_connection(writer)
        if out.status not in _EXPECTED[item.kind]:
            out.wrong = f"status {out.status}, expected {_EXPECTED[item.kind]}"

    async def run_item(self, item: _Item) -> list[Outcome]:
        async def one(item: _Item) -> Outcome:
            out = Outcome(item.kind, str(item.variant))
            try:
                async with asyncio.timeout(self.settings.timeout):
                    if item.kind in ("plain", "stream", "slow"):
                        await self._checked(item, out, retry=True)
                    elif item.kind == "burst":
                        await self._checked(item, out, retry=False)
                    elif item.kind == "disconnect":
                        await self._disconnect(item, out)
                    elif item.kind == "too_large":
                        await self._too_large(item, out)
                    elif item.kind == "bad_utf8":
                        await self._refused(item, out, *self._bad_utf8(item))
                    else:
                        await self._refused(item, out, *self._deep_json(item))
            except TimeoutError:
                if item.kind in CHECKED:
                    out.lost = f"no answer within {self.settings.timeout:g} s"
                elif item.kind != "disconnect":
                    out.wrong = f"no answer within {self.settings.timeout:g} s"
            return out

        if item.kind != "burst":
            return [await one(item)]
        members = [
            dataclasses.replace(item, prompt=(item.prompt + k) % len(self.prompts), variant=k)
            for k in range(self.settings.burst)
        ]
        return list(await asyncio.gather(*(one(m) for m in members)))

    # -- phases -------------------------------------------------------------------------------

    def items(self, requests: int, mix: dict[str, float]) -> list[_Item]:
        """`requests` requests drawn in the proportions of `mix`, shuffled."""
        total = sum(mix.values())
        kinds: list[str] = []
        for kind, share in mix.items():
            n = round(requests * share / total)
            if kind == "burst":
                n = max(1, round(n / self.settings.burst)) if share else 0
            kinds += [kind] * n
        self.rng.shuffle(kinds)
        items, seen = [], dict.fromkeys(mix, 0)
        for kind in kinds:  # each kind's variants in turn: a few requests cover them all
            prompt = self.rng.randrange(len(self.prompts))
            items.append(_Item(kind, prompt, self.rng.choice(self.settings.max_tokens), seen[kind]))
            seen[kind] += 1
        return items

    async def _phase(self, items: list[_Item]) -> dict[str, Any]:
        outcomes: list[Outcome] = []
        samples: list[tuple[float, int, float]] = []
        rss_at: float | None = None
        queue = iter(items)
        start = time.perf_counter()

        async def client() -> None:
            nonlocal rss_at
            for item in queue:
                outcomes.extend(await self.run_item(item))
                if rss_at is None and len(outcomes) >= self.settings.rss_at:
                    rss_at = rss_mib(self.pid)

        async def sampler() -> None:
            while True:
                samples.append((time.perf_counter() - start, len(outcomes), rss_mib(self.pid)))
                if self.settings.progress and len(samples) % 30 == 0:
                    t, n, rss = samples[-1]
                    print(f"[soak] {t:.0f} s: {n} answered, RSS {rss:.0f} MiB", file=sys.stderr)
                await asyncio.sleep(1.0)

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(client() for _ in range(self.settings.clients)))
        finally:
            sampling.cancel()
        wall = time.perf_counter() - start
        rss_end = rss_mib(self.pid)
        samples.append((wall, len(outcomes), rss_end))
        if rss_at is None:  # a phase shorter than `rss_at`
            rss_at = rss_end
        drained = await self._drained()
        return {
            "outcomes": outcomes,
            "wall_s": wall,
            "rss_at": rss_at,
            "rss_end": rss_end,
            "rss_samples": samples,
            "drained": drained,
            "load_average": os.getloadavg(),  # other work on the machine skews the latencies
        }

    async def _drained(self, wait: float = 30.0) -> bool:
        """Whether the server's queue and slots empty within `wait` seconds (no request left
        holding a slot after its client went away)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                _, _, body = await get(self.port, "/metrics")
            except (NoAnswer, OSError, TimeoutError):
                return False
            values = dict(
                re.findall(
                    r"^(lowbit_(?:queue_length|busy_slots)) (\S+)$", body.decode(), re.MULTILINE
                )
            )
            if values and all(float(v) == 0 for v in values.values()):
                return True
            await asyncio.sleep(0.2)
        return False

    def run_phase(self, requests: int, mix: dict[str, float] | None = None) -> dict[str, Any]:
        """Runs `requests` requests of `mix` (default `MIX`) over `Settings.clients` clients;
        returns `summarize`'s dict."""
        result = asyncio.run(self._phase(self.items(requests, MIX if mix is None else mix)))
        result["health"] = health(self.port)
        result["alive"] = self.proc.poll() is None
        return summarize(result)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Counts and percentiles of one phase (see the module docstring)."""
    outcomes: list[Outcome] = result["outcomes"]
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        counts = by_kind.setdefault(o.kind, {})
        key = "none" if o.status is None else str(o.status)
        counts[key] = counts.get(key, 0) + 1
    latencies = [o.latency for o in outcomes if o.kind in WELL_BEHAVED and o.latency and not o.lost]
    p50, p99 = np.percentile(latencies, [50, 99]).tolist() if latencies else (None, None)
    return {
        "requests": len(outcomes),
        "wall_s": result["wall_s"],
        "statuses": by_kind,
        "server_errors": sum(o.status is not None and o.status >= 500 for o in outcomes),
        "wrong": sum(o.wrong is not None for o in outcomes),
        "lost": sum(o.lost is not None for o in outcomes),
        "failures": [
            f"{o.kind}/{o.variant}: {o.wrong or o.lost}" for o in outcomes if o.wrong or o.lost
        ][:20],
        "well_behaved": len(latencies),
        "well_behaved_429": sum(o.retries for o in outcomes if o.kind in WELL_BEHAVED),
        "p50_s": p50,
        "p99_s": p99,
        "rss_at_mib": result["rss_at"],
        "rss_end_mib": result["rss_end"],
        "rss_samples": result["rss_samples"],
        "drained": result["drained"],
        "load_average": result["load_average"],
        "health": result["health"],
        "alive": result["alive"],
    }
