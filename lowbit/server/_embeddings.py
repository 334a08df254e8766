"""``POST /v1/embeddings``: the request body, the compiled program, the batches it runs in and
the answer's vectors.

A text's embedding is the mean of the model's last hidden states over the text's tokens,
L2-normalized (`lowbit.models.mean_pool`, as sentence-transformers pools): for a decoder the
final norm's output, before the LM head (`Decoder.hidden_states`); for an encoder (BERT,
MiniLM) its last layer's output.

Inputs run in batches of ``R`` rows of ``W`` tokens, right-padded: ``W`` is one of a few
widths from `MIN_WIDTH` to the longest input accepted (`embedding_widths`), and ``R * W`` is
at most the scheduler's one-pass prefill length, so a batch costs about what a prefill pass
costs and runs between decode steps as a prefill pass does. Padding is left out of the mean;
with a decoder's causal attention it is also never seen by the text's own tokens (an encoder
masks it in attention), so a text's vector does not depend on the batch it ran in, up to
float rounding.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.engine import interpret
from lowbit.models import mean_pool
from lowbit.server._protocol import bad, unicode_text

# Inputs one request may embed.
MAX_INPUTS = 256
# The narrowest batch width (shorter inputs are padded to it).
MIN_WIDTH = 16
ENCODING_FORMATS = ("float", "base64")
_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` body.

    Attributes:
      inputs: each input's text, or its token ids.
      encoding_format: ``"float"`` (lists of numbers) or ``"base64"`` (little-endian float32
        bytes, base64-encoded).
      dimensions: the width asked for, or None (checked against the model's by the app).
      listed: `inputs` came as a list (errors name ``input[i]``), not as one input (``input``).
    """

    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str
    dimensions: int | None
    listed: bool = True

    def field(self, i: int) -> str:
        """The request field holding input `i`."""
        return f"input[{i}]" if self.listed else "input"


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four forms of ``input``: a string, a list of strings, a list of token ids, a
    list of lists of token ids."""
    if value is None:
        raise bad("input", "is required", code="missing_field")
    if isinstance(value, str) or (_token_ids(value) and value):
        return _inputs_of([value], "input")
    return _inputs_of(value, None)


def _inputs_of(value: Any, name: str | None) -> tuple[str | tuple[int, ...], ...]:
    """The inputs of a list; `name` is the field naming them all, None for ``input[i]``."""
    if not isinstance(value, list) or not value:
        raise bad(
            "input",
            "must be a non-empty string, a list of them, a list of token ids or a list of "
            "lists of token ids",
        )
    if len(value) > MAX_INPUTS:
        raise bad("input", f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        field = name or f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad(field, "is an empty string; give text to embed")
            out.append(unicode_text(field, item))
        elif _token_ids(item):
            if not item:
                raise bad(field, "is an empty list of token ids")
            out.append(tuple(item))
        else:
            raise bad(field, "must be a non-empty string or a non-empty list of token ids")
    if len({type(item) for item in out}) > 1:
        raise bad("input", "mixes texts and lists of token ids; send one kind")
    return tuple(out)


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """Validates a ``/v1/embeddings`` body.

    Raises:
      APIError: 400 naming the field for anything malformed or unsupported.
    """
    for name in body:
        if name not in _FIELDS:
            raise bad(name, "is not a field this endpoint accepts", code="unknown_field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "must be a string")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise bad("encoding_format", f"must be float or base64, got {json.dumps(encoding)}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise bad("dimensions", f"must be a positive integer, got {json.dumps(dimensions)}")
    value = body.get("input")
    listed = not (isinstance(value, str) or (_token_ids(value) and value))
    return EmbeddingRequest(_inputs(value), encoding, dimensions, listed)


def input_ids(request: EmbeddingRequest, tokenizer: Any, vocab: int, limit: int) -> list[list[int]]:
    """Each input's token ids (texts encoded by `tokenizer`, as a completion's prompt is).

    Raises:
      APIError: 400 naming ``input[i]`` for an input of no tokens, a token id outside the
        vocabulary of `vocab`, or more than `limit` tokens.
    """
    out = []
    for i, item in enumerate(request.inputs):
        name = request.field(i)
        ids = tokenizer.encode(item).ids if isinstance(item, str) else list(item)
        if not ids:
            raise bad(name, "encodes to no tokens")
        if max(ids) >= vocab:
            raise bad(name, f"token id {max(ids)} is outside the vocabulary of {vocab}")
        if len(ids) > limit:
            raise bad(
                name,
                f"has {len(ids)} tokens; this server embeds at most {limit} tokens per input "
                "(its --prefill-chunk). Shorten or split the input",
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def answer_body(
    request: EmbeddingRequest, vectors: np.ndarray, model: str, tokens: int
) -> dict[str, Any]:
    """OpenAI's answer: ``vectors [N, D]`` in `request`'s encoding; `tokens` in all."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, request.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One ``[D]`` vector as the answer carries it: numbers, or base64 of little-endian
    float32 bytes (what OpenAI's clients decode)."""
    vector = np.asarray(vector, "<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


# -- the program and its batches ---------------------------------------------------------------


def embedding_widths(budget: int) -> list[int]:
    """The batch widths: the largest power of two at most `budget` (the longest input
    accepted; `budget` >= `MIN_WIDTH`), after `MIN_WIDTH` times the powers of four below it.
    Steps of four keep the programs few (each costs start time) at up to four times the
    padding."""
    top = MIN_WIDTH
    while top * 2 <= budget:
        top *= 2
    widths, width = [], MIN_WIDTH
    while width < top:
        widths.append(width)
        width *= 4
    return [*widths, top]


def embed(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """Embeddings of right-padded inputs: ``tokens [R, W]`` int32 whose row r holds
    ``lengths[r]`` real tokens (0 for an unused row) -> ``[R, D]`` float32, unit norm (an
    unused row is zeros)."""

    def run(params, tokens, lengths):
        model = nnx.merge(graphdef, params)
        mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        if hasattr(model, "hidden_states"):  # a decoder: causal, padding unseen
            hidden = model.hidden_states(tokens)
        else:  # an encoder attends both ways: the mask keeps the padding out
            hidden = model(tokens, mask)
        return mean_pool(hidden, mask)

    return interpret(run)(params, tokens, lengths)


@dataclasses.dataclass(eq=False)
class EmbedJob:
    """One embeddings request as the scheduler sees it.

    Attributes:
      inputs: each input's token ids (each at least one, at most the widest width).
      deadline: ``time.monotonic()`` after which it ends with ``"timeout"``.
      done: called once from the scheduler thread: with the vectors ``[N, D]`` float32 and
        None, or with None and the reason it ended early (cancelled, timeout, shutdown).
      cancelled: set by the HTTP side (the client went away).
      vectors: each input's ``[D]`` vector once its batch has run (the scheduler fills them).
      finished: `done` has been called.
    """

    inputs: Sequence[Sequence[int]]
    deadline: float
    done: Callable[[np.ndarray | None, str | None], None]
    cancelled: bool = False
    vectors: list[np.ndarray | None] = dataclasses.field(init=False)
    finished: bool = False

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)


def batch_rows(width: int, budget: int) -> int:
    """Rows of a batch of `width`: `budget` tokens in all (at least one row)."""
    return max(1, budget // width)


def next_batch(job: EmbedJob, widths: Sequence[int], budget: int) -> tuple[int, list[int]]:
    """The width and the input indices of `job`'s next batch: the first input not yet
    embedded sets the width, and the batch takes the inputs of that width after it, up to
    `batch_rows`."""
    width_of = lambda n: next(w for w in widths if w >= n)  # noqa: E731
    left = [i for i, v in enumerate(job.vectors) if v is None]
    width = width_of(len(job.inputs[left[0]]))
    same = [i for i in left if width_of(len(job.inputs[i])) == width]
    return width, same[: batch_rows(width, budget)]


def batch_arrays(
    inputs: Sequence[Sequence[int]], indices: Sequence[int], width: int, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """``tokens [rows, width]`` int32 (right-padded with 0) and ``lengths [rows]`` int32 of
    the inputs at `indices` (rows past them are unused: length 0)."""
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.zeros((rows,), np.int32)
    for row, i in enumerate(indices):
        tokens[row, : len(inputs[i])] = inputs[i]
        lengths[row] = len(inputs[i])
    return tokens, lengths
