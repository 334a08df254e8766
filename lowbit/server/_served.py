"""What `lowbit serve`'s app serves: the model's name, tokenizer, chat template and scheduler,
and the limits every request meets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lowbit.server._limits import MAX_BODY_BYTES, READ_TIMEOUT
from lowbit.server._scheduler import Scheduler


@dataclasses.dataclass(frozen=True, eq=False)
class ServedModel:
    """What the app serves.

    Attributes:
      name: the model id `/v1/models` lists.
      tokenizer: a `tokenizers.Tokenizer`.
      chat_template: ``messages -> prompt text`` (a `ChatTemplate`), or None (no chat).
      stop_ids: token ids that end every answer (end of turn, end of text).
      scheduler: the running `Scheduler`.
      api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
      request_timeout: seconds a request may take from arrival to its last token.
      max_body_bytes: the largest request body accepted; larger ones get a 413.
      read_timeout: seconds a client has to send a request's head, and again its body; a
        slower one is dropped (a 408 for a body) before it reaches the scheduler.
    """

    name: str
    tokenizer: Any
    chat_template: Callable[..., str] | None
    stop_ids: frozenset[int]
    scheduler: Scheduler
    api_key: str | None = None
    request_timeout: float = 600.0
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = READ_TIMEOUT

    @property
    def embedding_dim(self) -> int:
        """The width of the model's embeddings (``/v1/embeddings``)."""
        return self.scheduler.model.config.dim
