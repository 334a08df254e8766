"""How the scheduler's programs are compiled: which function each name runs, the buffers it
reuses in place (donated), the structure of its outputs, and the key it is kept under.

Names are those of `lowbit.server._programs` (the served model's steps and the cache's moves),
``"embed"`` (`lowbit.server._embeddings.embed`), and ``"draft_<step>"``: a step of the draft
model of speculative decoding (`lowbit.server._draft_rows`) on its own graph.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from lowbit.api import StoredProgram, compile_stored
from lowbit.server import _embeddings as embeddings
from lowbit.server import _programs as programs
from lowbit.server._logprobs import TokenLogprobs
from lowbit.server._programs import Decoded

# The model's programs, and the positions among their arguments of the buffers they reuse:
# the KV cache, and the decode steps' token counts.
MODEL_PROGRAMS = {
    "decode": (1, 4),
    "decode_logprobs": (1, 4),
    "decode_rows": (1, 4),
    "decode_rows_logprobs": (1, 4),
    "verify": (1,),
    "prefill": (2,),
    "prefill_chunk": (2,),
}
# The structure of each program's output ahead of its first value (leaves: anything).
_OUT_LIKE = {
    "decode": lambda a: (Decoded(0, 0, None), a[1]),
    "decode_logprobs": lambda a: (Decoded(0, 0, TokenLogprobs(0, 0, 0)), a[1]),
    "decode_rows": lambda a: (Decoded(0, 0, None), a[1]),
    "decode_rows_logprobs": lambda a: (Decoded(0, 0, TokenLogprobs(0, 0, 0)), a[1]),
    "verify": lambda a: (0, a[1]),
    "prefill": lambda a: ((0, 0), a[2]),
    "prefill_chunk": lambda a: (0, a[2]),
    "sample": lambda a: 0,
    "logprobs": lambda a: TokenLogprobs(0, 0, 0),
}


@dataclasses.dataclass(frozen=True)
class Source:
    """A model's graph definition, and the description of what its programs are traced from
    (graph, configuration, KV cache format; `lowbit.api.describe`), their kept forms' key."""

    graphdef: Any
    static: str


def compile_program(
    name: str,
    width: int | tuple[int, int],
    args: tuple,
    model: Source,
    embedder: Source,
    draft: Source | None,
    directory: str | os.PathLike[str] | None,
) -> StoredProgram:
    """Program `name` compiled for arguments shaped like `args` (`width` tells its shapes
    apart in its name), its traced form kept in `directory` (`lowbit.api.compile_stored`).

    Args:
      model: the served model (its steps), `embedder`: the same model as ``"embed"`` runs it,
      draft: the draft model (``"draft_<step>"``), or None.
    """
    base = name.removeprefix("draft_")
    fn = getattr(embeddings if name == "embed" else programs, base)
    static, donate = "", (0,)  # the moves: cache -> cache
    out_like = _OUT_LIKE.get(name, lambda a: a[0])
    if base != name:
        out_like = _OUT_LIKE.get(base, out_like)
        if base in MODEL_PROGRAMS:
            fn = functools.partial(fn, draft.graphdef)
            static, donate = draft.static, MODEL_PROGRAMS[base]
    elif name == "embed":
        fn = functools.partial(fn, embedder.graphdef)
        static = embedder.static
        out_like, donate = (lambda a: 0), ()
    elif name in MODEL_PROGRAMS:
        fn = functools.partial(fn, model.graphdef)
        static, donate = model.static, MODEL_PROGRAMS[name]
    elif name in ("sample", "logprobs"):  # small programs of logits: nothing to reuse
        donate = ()
    label = width if isinstance(width, int) else "x".join(map(str, width))
    return compile_stored(
        f"{name}-{label}",
        fn,
        args,
        static=static,
        out_like=out_like,
        donate_argnums=donate,
        directory=directory,
    )
