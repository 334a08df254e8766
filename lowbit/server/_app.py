"""The Starlette app: OpenAI's completion and chat endpoints, models, health and metrics.

Handlers validate and tokenize on the event loop, hand a `Job` to the `Scheduler` and turn the
tokens it emits into text: one JSON answer, or server-sent events (``data: {...}`` chunks, then
``data: [DONE]``). A client that goes away cancels its job, which frees its slot at the next
step.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lowbit.server import _embeddings as embeddings
from lowbit.server._answer import POLL, Answer, ending_error
from lowbit.server._grammar import Constraint, GrammarError, Grammars
from lowbit.server._guidance import parse_guidance
from lowbit.server._job import Job, NotReady, QueueFull
from lowbit.server._limits import BodyLimit
from lowbit.server._metrics import CONTENT_TYPE, Metrics
from lowbit.server._openapi import openapi_document
from lowbit.server._protocol import APIError, CompletionRequest, bad, parse_body, parse_request
from lowbit.server._scheduler import Scheduler
from lowbit.server._served import ServedModel
from lowbit.server._tool_grammar import schema_problem, tool_grammar
from lowbit.server._tool_prompt import answer_format, chat_prompt
from lowbit.server._tool_request import ToolRequest

# Seconds a client is told to wait after a 429.
RETRY_AFTER = 1
# Seconds a response_format's schema may take to compile (llguidance's limits bound it well
# below this; the wait is a second bound).
COMPILE_TIMEOUT = 10.0


def _check_ready(scheduler: Scheduler) -> None:
    """A 503 while the scheduler compiles its programs (or after it failed)."""
    if not scheduler.ready or scheduler.error is not None:
        raise APIError(
            503,
            "the model is loading; retry when /health says ok",
            type="server_error",
            code="loading",
        )


def _submit(submit: Callable[[], None]) -> None:
    """Runs `submit` (a hand-over to the scheduler): a full queue is a 429, a scheduler still
    compiling or shutting down a 503."""
    try:
        submit()
    except QueueFull as err:
        raise APIError(
            429,
            f"the server is busy ({err}); retry later",
            type="rate_limit_error",
            code="queue_full",
        ) from None
    except NotReady as err:
        raise APIError(503, str(err), type="server_error", code="unavailable") from None


def _error(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _EventStream(StreamingResponse):
    """Server-sent events that watch for the client going away on every ASGI version (and
    call `on_close` however the stream ends)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()


class _Handler:
    """The endpoints of one `ServedModel`."""

    def __init__(self, served: ServedModel, metrics: Metrics):
        self.served = served
        self.metrics = metrics
        self.created = int(time.time())
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.served.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()
        )
        if not ok:
            raise APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )

    def wrap(self, endpoint: str, handler: Callable) -> Callable:
        async def run(request: Request) -> Response:
            try:
                if endpoint != "/health":
                    self._authorize(request)
                response = await handler(request)
            except APIError as err:
                headers = {"Retry-After": str(RETRY_AFTER)} if err.status == 429 else None
                response = _error(err, headers)
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return run

    # -- endpoints ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        s = self.served.scheduler
        if s.error is not None:
            return JSONResponse({"status": "error", "error": str(s.error)}, status_code=500)
        if not s.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        # Programs the first requests rarely need still compile in the background meanwhile.
        return JSONResponse({"status": "ok", "compiling": s.programs.pending})

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "lowbit",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def openapi(self, request: Request) -> Response:
        s = self.served.scheduler
        vocab = self.served.tokenizer.get_vocab_size()
        most = min(s.config.slots, s.config.queue)
        document = openapi_document(
            self.served.name,
            vocab,
            s.config.max_len,
            most,
            embedding_dim=self.served.embedding_dim if s.embed_widths else None,
            embedding_tokens=s.max_embedding_tokens,
        )
        return JSONResponse(document)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        s = self.served.scheduler
        if not s.embed_widths:
            raise APIError(
                400,
                f"this server does not embed with {self.served.name}: start lowbit serve with "
                "--embeddings",
                param="model",
                code="embeddings_disabled",
            )
        req = embeddings.parse_embedding_request(parse_body(await request.body()))
        _check_ready(s)
        width = self.served.embedding_dim
        if req.dimensions is not None and req.dimensions != width:
            raise bad(
                "dimensions",
                f"is {req.dimensions}; this model's embeddings have {width} (omit it or send "
                f"{width})",
                code="unsupported",
            )
        tok = self.served.tokenizer
        ids = embeddings.input_ids(req, tok, tok.get_vocab_size(), s.max_embedding_tokens)
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()

        def done(vectors, reason) -> None:
            try:
                loop.call_soon_threadsafe(result.set_result, (vectors, reason))
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        deadline = time.monotonic() + self.served.request_timeout
        job = embeddings.EmbedJob(inputs=ids, deadline=deadline, done=done)
        _submit(lambda: s.submit_embedding(job))
        try:
            while not result.done():
                await asyncio.wait([result], timeout=POLL)
                if not result.done() and await request.is_disconnected():
                    return Response(status_code=499)
        finally:
            if not result.done():
                s.cancel(job)
        vectors, reason = result.result()
        if vectors is None:
            raise ending_error(reason) or APIError(
                503, "the request was cancelled", type="server_error", code="cancelled"
            )
        tokens = sum(len(i) for i in ids)
        return JSONResponse(embeddings.answer_body(req, vectors, self.served.name, tokens))

    # -- generation ---------------------------------------------------------------------------

    def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        tok = self.served.tokenizer
        if req.chat:
            if self.served.chat_template is None:
                raise APIError(
                    400,
                    "this model has no chat template (tokenizer.chat_template in its GGUF "
                    "file); use /v1/completions with a formatted prompt",
                    param="messages",
                    code="no_chat_template",
                )
            try:
                text = chat_prompt(self.served.chat_template, req.messages, req.tools)
            except ValueError as err:
                raise bad("messages", str(err)) from None
            ids = tok.encode(text).ids
        elif isinstance(req.prompt, str):
            ids = tok.encode(req.prompt).ids
        else:
            ids = list(req.prompt)
            vocab = tok.get_vocab_size()
            if max(ids) >= vocab:
                raise bad("prompt", f"token id {max(ids)} is outside the vocabulary of {vocab}")
        if not ids:
            raise bad("prompt" if not req.chat else "messages", "encodes to no tokens")
        return ids

    def _vocab(self) -> int:
        """Token ids a request may name: the tokenizer's that the model has logits for."""
        width = self.served.scheduler.model.config.vocab_size
        return min(self.served.tokenizer.get_vocab_size(), width)

    def _constraint(self, grammar: dict[str, Any] | str) -> Constraint:
        """A fresh grammar state for a JSON schema or a Lark grammar (run in a worker thread:
        it may take a while)."""
        with self._grammars_lock:  # adapting the vocabulary takes up to a second: once
            if self._grammars is None:
                s = self.served
                width = s.scheduler.model.config.vocab_size
                self._grammars = Grammars(s.tokenizer, s.stop_ids, width)
        if isinstance(grammar, str):
            return self._grammars.constrain_lark(grammar)
        return self._grammars.constrain(grammar)

    async def _compile(
        self,
        grammar: dict[str, Any] | str,
        param: str = "response_format.json_schema.schema",
        field: str = "response_format",
    ) -> Constraint:
        try:
            work = asyncio.to_thread(self._constraint, grammar)
            return await asyncio.wait_for(work, COMPILE_TIMEOUT)
        except TimeoutError:
            raise bad(param, f"took over {COMPILE_TIMEOUT:g} s to compile; simplify it") from None
        except GrammarError as err:
            raise bad(param, f"cannot be used for constrained decoding: {err}") from None
        except Exception as err:  # noqa: BLE001 - the tokenizer cannot be adapted: never a 500
            raise bad(
                field,
                f"this model's tokenizer does not support structured output ({err})",
                code="unsupported",
            ) from None

    async def _tool_grammar(self, tools: ToolRequest) -> str:
        """The Lark grammar of a forced tool answer, once each tool's schema is known to
        compile (else a 400 naming the first that does not)."""
        problem = await asyncio.to_thread(schema_problem, tools)
        if problem is not None:
            param, why = problem
            raise bad(param, f"cannot be used for constrained decoding: {why}")
        return tool_grammar(tools, answer_format(self.served.chat_template))

    async def _generate(self, request: Request, chat: bool) -> Response:
        s = self.served.scheduler
        if not s.generates:
            raise APIError(
                400,
                f"{self.served.name} is an encoder: it embeds text (/v1/embeddings) and "
                "generates none",
                param="model",
                code="model_not_supported",
            )
        body = parse_body(await request.body())
        req = parse_request(body, chat)
        guidance = parse_guidance(body, self._vocab())
        _check_ready(s)
        ids = self._prompt_ids(req)
        context = s.config.max_len
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(16, context - len(ids) + 1) if not chat else context - len(ids) + 1
            max_tokens = max(max_tokens, 1)
        why = s.check_fits(len(ids), max_tokens)
        if why is not None:
            param = "max_tokens" if "max_tokens" in why else ("messages" if chat else "prompt")
            raise bad(param, why, code="context_length_exceeded")
        why = s.check_choices(req.n, len(ids), max_tokens)
        if why is not None:
            raise bad("n", why)
        if (body.get("max_tokens") or 0) > context:  # overridden by max_completion_tokens
            raise bad("max_tokens", f"must be at most the context, {context} tokens")
        # Each choice follows the grammar with a matcher of its own.
        grammar: dict[str, Any] | str | None = guidance.schema
        param, field = "response_format.json_schema.schema", "response_format"
        if req.tools is not None and req.tools.forced:  # the answer must be calls
            if guidance.schema is not None:
                raise bad(
                    "response_format",
                    "cannot be combined with tool_choice required or a named function (the "
                    "answer is tool calls)",
                )
            grammar = await self._tool_grammar(req.tools)
            param, field = "tools", "tool_choice"
        constraints = [
            None if grammar is None else await self._compile(grammar, param, field)
            for _ in range(req.n)
        ]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(index: int) -> Callable[[list[int], str | None], None]:
            def emit(tokens: list[int], finish: str | None) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, tokens, finish))
                except RuntimeError:  # the event loop has closed (shutdown): nobody listens
                    pass

            return emit

        seed = secrets.randbits(32) if req.seed is None else req.seed
        deadline = time.monotonic() + self.served.request_timeout
        jobs = [
            Job(
                prompt=ids,
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=(seed + i) % 2**32,  # choice i draws with seed + i: choice 0 is n = 1's
                stop_ids=self.served.stop_ids,
                deadline=deadline,
                emit=emitter(i),
                logprobs=req.logprobs,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=guidance.logit_bias,
                constraint=constraints[i],
            )
            for i in range(req.n)
        ]
        _submit(lambda: s.submit_all(jobs))
        self.metrics.prompt_tokens.inc(len(ids))
        answer = Answer(self.served, self.metrics, req, jobs, events)
        if req.stream:
            return _EventStream(answer.stream(), on_close=answer.close)
        try:
            return await answer.whole(request)
        finally:
            answer.close()


def create_app(served: ServedModel) -> Starlette:
    """The ASGI app serving `served` (its scheduler started and stopped with the app)."""
    s = served.scheduler
    metrics = Metrics(
        lambda: s.queue_length,
        lambda: s.busy_slots,
        s.config.slots,
        None if s.prefill is None else s.prefill.prefix,
        compiling=lambda: s.programs.pending,
        speculation=s.speculation,
    )
    h = _Handler(served, metrics)
    routes = [
        Route("/health", h.wrap("/health", h.health), methods=["GET"]),
        Route("/metrics", h.wrap("/metrics", h.metrics_text), methods=["GET"]),
        Route("/v1/models", h.wrap("/v1/models", h.models), methods=["GET"]),
        Route("/openapi.json", h.wrap("/openapi.json", h.openapi), methods=["GET"]),
        Route("/v1/completions", h.wrap("/v1/completions", h.completions), methods=["POST"]),
        Route("/v1/chat/completions", h.wrap("/v1/chat/completions", h.chat), methods=["POST"]),
        Route("/v1/embeddings", h.wrap("/v1/embeddings", h.embeddings), methods=["POST"]),
    ]
    paths = {route.path for route in routes}

    def refused(path: str, status: int) -> None:
        metrics.requests.labels(path if path in paths else "other", str(status)).inc()

    # Every body is read whole, bounded in size and time, before a handler runs.
    limit = Middleware(
        BodyLimit,
        max_bytes=served.max_body_bytes,
        timeout=served.read_timeout,
        on_refused=refused,
    )
    app = Starlette(routes=routes, middleware=[limit])
    app.state.served = served
    app.state.metrics = metrics
    return app
