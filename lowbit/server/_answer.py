"""One request's answer: the tokens its jobs emit (one job a choice) turned into text, tool
calls and log-probabilities, as one OpenAI JSON object or as server-sent event chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lowbit.server._job import CANCELLED, LENGTH, SHUTDOWN, STOP, TIMEOUT, Job
from lowbit.server._logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from lowbit.server._metrics import Metrics
from lowbit.server._protocol import APIError, CompletionRequest
from lowbit.server._served import ServedModel
from lowbit.server._text import TextStream
from lowbit.server._tool_calls import Parsed, ToolCallStream
from lowbit.server._tool_prompt import tool_call_stream

# Seconds between checks that a non-streaming client is still connected.
POLL = 0.25


def ending_error(finish: str) -> APIError | None:
    """The error answered for a job that ended `finish` without an answer (past its deadline,
    or the server shutting down), or None."""
    if finish == TIMEOUT:
        return APIError(504, "the request passed its deadline", type="timeout", code="timeout")
    if finish == SHUTDOWN:
        return APIError(
            503, "the server is shutting down", type="server_error", code="shutting_down"
        )
    return None


@dataclasses.dataclass(eq=False)
class Choice:
    """One choice of an answer: its job and what it has produced so far.

    Attributes:
      finish: the scheduler's finish reason (or STOP at a stop string) once it ended.
      reason: the finish reason answered (stop or length), once answered.
      offset: the completions ``text_offset`` of its next token.
    """

    index: int
    job: Job
    text: TextStream
    ids: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    reason: str | None = None
    offset: int = 0
    calls: ToolCallStream | None = None  # the parser of its text, when tools are offered


class Answer:
    """Turns the emitted tokens of one request's jobs (one per choice) into text and the
    OpenAI answer objects."""

    def __init__(
        self,
        served: ServedModel,
        metrics: Metrics,
        req: CompletionRequest,
        jobs: list[Job],
        events: asyncio.Queue,
    ):
        self.served = served
        self.metrics = metrics
        self.req = req
        tokenizer = served.tokenizer
        self.choices = [
            Choice(i, job, TextStream(tokenizer, req.stop)) for i, job in enumerate(jobs)
        ]
        self.texts = TokenTexts(tokenizer) if req.logprobs is not None else None
        self.events = events
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.recorded = False
        # With tools shown (tool_choice not none), each choice's text goes through a parser.
        for choice in self.choices:
            choice.calls = tool_call_stream(served.chat_template, req.tools)

    def close(self) -> None:
        """Ends the jobs still running (the client left, or the answer is complete)."""
        for choice in self.choices:
            if choice.job.finished is None:
                self.served.scheduler.cancel(choice.job)
        self._record()

    def _record(self) -> None:
        if self.recorded:
            return
        self.recorded = True
        m = self.metrics
        for choice in self.choices:
            job = choice.job
            m.finished.labels(choice.reason or job.finished or CANCELLED).inc()
            m.generated_tokens.inc(len(choice.ids))
            if job.first_token is not None:
                m.ttft.observe(job.first_token - job.submitted)
                if len(choice.ids) > 1:
                    m.tpot.observe((time.monotonic() - job.first_token) / (len(choice.ids) - 1))

    async def _next(self) -> tuple[Choice, str, str | None, int]:
        """The next piece of text of some choice, its finish reason at the end (None before),
        and how many of the choice's tokens came before."""
        while True:
            index, tokens, finish = await self.events.get()
            choice = self.choices[index]
            if choice.finish is None:  # else: it ended at a stop string; its job was cancelled
                break
        before = len(choice.ids)
        choice.ids.extend(tokens)
        piece = choice.text.add(tokens)
        if choice.text.stopped:
            self.served.scheduler.cancel(choice.job)
            finish = STOP
        elif finish is not None:
            piece += choice.text.finish()
        choice.finish = finish
        return choice, piece, finish, before

    def _usage(self) -> dict[str, int]:
        prompt = len(self.choices[0].job.prompt)
        completion = sum(len(choice.ids) for choice in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.choices[0].job.cached_tokens},
        }

    def _logprobs(self, choice: Choice, before: int) -> dict[str, Any] | None:
        """The log-probabilities of `choice`'s tokens from index `before` on, if asked for."""
        if self.texts is None:
            return None
        ids = choice.ids[before:]
        # The scheduler appends a token's entry before handing the token over.
        entries = choice.job.token_logprobs[before : len(choice.ids)]
        if self.req.chat:
            return chat_logprobs(ids, entries, self.texts)
        out, choice.offset = completion_logprobs(ids, entries, self.texts, choice.offset)
        return out

    def _choice(
        self,
        choice: Choice,
        text: str | None,
        finish: str | None,
        before: int,
        delta: bool,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        out: dict[str, Any] = {"index": choice.index}
        if self.req.chat:
            key = "delta" if delta else "message"
            out[key] = {"role": "assistant", "content": text} if not delta else {"content": text}
            if tool_calls:
                out[key]["tool_calls"] = tool_calls
            if self.texts is not None:
                out["logprobs"] = self._logprobs(choice, before)
        else:
            out["text"] = text
            out["logprobs"] = self._logprobs(choice, before)
        out["finish_reason"] = finish
        if self.req.return_token_ids:
            out["token_ids"] = choice.ids[before:]
        return out

    def _answered(self, choice: Choice) -> str:
        choice.reason = STOP if choice.finish == STOP else LENGTH
        return choice.reason

    async def whole(self, request: Request) -> Response:
        parts: list[list[str]] = [[] for _ in self.choices]
        while any(choice.finish is None for choice in self.choices):
            try:
                choice, piece, _, _ = await asyncio.wait_for(self._next(), POLL)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            parts[choice.index].append(piece)
        for choice in self.choices:
            failure = ending_error(choice.finish)
            if failure is not None:
                raise failure
        choices = []
        for choice in self.choices:
            text: str | None = "".join(parts[choice.index])
            reason, calls = self._answered(choice), None
            if choice.calls is not None:
                choice.calls.add(text)
                parsed = choice.calls.finish()[1]
                if parsed.calls:
                    text, reason, calls = parsed.content, "tool_calls", tool_calls(parsed)
            choices.append(self._choice(choice, text, reason, 0, False, calls))
        self._record()
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion" if self.req.chat else "text_completion",
                "created": self.created,
                "model": self.served.name,
                "choices": choices,
                "usage": self._usage(),
            }
        )

    def _chunk(self, choices: list, usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        if self.req.chat:  # each choice's first chunk carries the role
            for choice in self.choices:
                first = {
                    "index": choice.index,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
                yield self._chunk([first])
        while True:
            choice, piece, finish, before = await self._next()
            if choice.calls is not None:
                piece = choice.calls.add(piece)
            if finish is None:
                new = len(choice.ids) > before
                if piece or self.req.return_token_ids or (new and self.texts is not None):
                    yield self._chunk([self._choice(choice, piece, None, before, True)])
                continue
            failure = ending_error(finish)
            if failure is not None:
                yield f"data: {json.dumps(failure.body())}\n\n"
                return
            if finish == CANCELLED:
                return
            reason = self._answered(choice)
            parsed = None
            if choice.calls is not None:
                rest, parsed = choice.calls.finish()
                piece += rest
            if parsed is not None and parsed.calls:
                # The content's rest, then one chunk per call, then the finish reason.
                if piece or self.req.return_token_ids:
                    yield self._chunk([self._choice(choice, piece, None, before, True)])
                end = len(choice.ids)
                for call in tool_calls(parsed, streamed=True):
                    yield self._chunk([self._choice(choice, None, None, end, True, [call])])
                yield self._chunk([self._choice(choice, None, "tool_calls", end, True)])
            else:
                yield self._chunk([self._choice(choice, piece, reason, before, True)])
            if any(other.reason is None for other in self.choices):
                continue
            self._record()
            if self.req.include_usage:
                yield self._chunk([], self._usage())
            yield "data: [DONE]\n\n"
            return


def tool_calls(parsed: Parsed, streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` of an answer (each with a fresh id; ``index`` when streamed)."""
    out = []
    for i, call in enumerate(parsed.calls):
        entry: dict[str, Any] = {"index": i} if streamed else {}
        entry["id"] = "call_" + uuid.uuid4().hex[:24]
        entry["type"] = "function"
        entry["function"] = {"name": call.name, "arguments": call.arguments_json}
        out.append(entry)
    return out
