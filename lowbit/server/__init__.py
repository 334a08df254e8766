"""`lowbit serve`: an OpenAI-compatible HTTP server with continuous batching.

`Scheduler` owns the compiled decode step and a fixed number of slots; `create_app` builds the
Starlette app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``,
``/v1/models``, ``/health``, ``/metrics``) around a `ServedModel`; `run` serves it on
uvicorn. See docs/serve.md.
"""

from lowbit.server._app import ServedModel, create_app
from lowbit.server._job import Job, NotReady, QueueFull, SchedulerConfig
from lowbit.server._protocol import APIError, CompletionRequest, parse_request
from lowbit.server._run import run
from lowbit.server._scheduler import Scheduler
from lowbit.server._speculate import DraftModel
from lowbit.server._text import TextStream

__all__ = [
    "APIError",
    "CompletionRequest",
    "DraftModel",
    "Job",
    "NotReady",
    "QueueFull",
    "Scheduler",
    "SchedulerConfig",
    "ServedModel",
    "TextStream",
    "create_app",
    "parse_request",
    "run",
]
