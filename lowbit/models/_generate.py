"""Text generation with a KV cache: the decode loop compiled into one program.

`generate_tokens` runs a batch of token prompts; `generate` takes and returns text. Both work on
float models and on quantized parameters (`QArray` leaves: any recipe, GGUF imports,
checkpoints), through the quantization engine.

How a call runs:

1. Prompts are left-padded to a shared bucketed length ``P`` (rows start at different cache
   slots; `KVCache.start` keeps each row's rotary positions at 0.. and masks the padding).
2. One compiled prefill writes the prompts into the cache and samples the first token.
3. One compiled decode loop (`lax.while_loop`) feeds each sampled token back, samples the next,
   and stops when every row has produced a stop token or `max_new_tokens` tokens. Its state
   (cache included) is donated, so the cache is updated in place. Streaming runs the same
   compiled loop for a few steps per call (`chunk`) and hands each chunk's tokens back.

With ``mesh=``, the forward pass runs tensor parallel over the mesh's ``"model"`` axis and
data parallel over its ``"data"`` axis (`lowbit.models._sharding`); the loop is the same.

Prompt lengths and cache sizes are rounded up to buckets (powers of two and three times powers
of two), so new lengths reuse compiled programs. Sampling draws step ``i``'s token with
``fold_in(key, i)``: a key gives the same tokens whether or not the loop is streamed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit._host_memory import releasing_after_compile
from lowbit.api import compile_together, describe, lower_stored
from lowbit.engine import interpret
from lowbit.models._chat_template import chat_template_from_gguf as chat_template_from_gguf
from lowbit.models._kv_cache import KVCache
from lowbit.models._sampling import Sampling, sample_logits
from lowbit.models._sharding import (
    GenerationSharding,
    fetch,
    put,
    shard_for_generation,
    sharded_forward,
)
from lowbit.recipes import KVCacheConfig, parse_kv_cache

# End-of-turn / end-of-text tokens of the supported families (ChatML, Llama 3, Gemma, Phi-3,
# SentencePiece); those a tokenizer does not know are skipped.
DEFAULT_STOP_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<eos>",
    "</s>",
)
# Stop ids are passed as a fixed-size array (padded with -1) so their values never recompile.
_MAX_STOP_IDS = 16
_MIN_BUCKET = 16
# Tokens per compiled call when streaming.
DEFAULT_CHUNK = 8


def bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (2^k and 3 * 2^k) that is >= n."""
    size = _MIN_BUCKET
    while True:
        if size >= n:
            return size
        if size * 3 // 2 >= n:
            return size * 3 // 2
        size *= 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry.

    Attributes:
      cache: the KV cache, holding every token fed so far.
      token: ``[batch]`` int32, the last sampled token (fed next).
      out: ``[batch, capacity]`` int32, sampled tokens; -1 after a row stopped.
      count: ``int32 []``, tokens written to `out`.
      done: ``[batch]`` bool, rows that produced a stop token.
    """

    cache: KVCache
    token: jax.Array
    out: jax.Array
    count: jax.Array
    done: jax.Array


@dataclasses.dataclass(frozen=True)
class _Sharded:
    """In place of a graphdef: run the decoder tensor / data parallel (`sharded_forward`)."""

    module_type: type
    config: Any
    dtype: Any
    plan: GenerationSharding


@dataclasses.dataclass(frozen=True, eq=False)
class _Graph:
    """A graphdef as a jit static argument, hashed once: nnx's `GraphDef` hashes its whole
    graph on every call (2 ms on SmolLM2), which jit does at each prefill and decode chunk."""

    graphdef: nnx.GraphDef
    digest: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "digest", hash(self.graphdef))

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Graph) or self.digest != other.digest:
            return False
        return self.graphdef == other.graphdef


def _forward(
    graphdef: nnx.GraphDef | _Graph | _Sharded,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    fresh: bool = False,
):
    # Only the last position's logits are sampled from; `fresh`: a prompt into a new cache.
    if isinstance(graphdef, _Graph):
        graphdef = graphdef.graphdef
    if isinstance(graphdef, _Sharded):
        g = graphdef
        return sharded_forward(
            g.module_type, g.config, g.dtype, g.plan, params, tokens, cache, fresh=fresh
        )
    return nnx.merge(graphdef, params)(tokens, cache=cache, last_only=True, fresh=fresh)


def _record(state: DecodeState, token: jax.Array, stop_ids: jax.Array) -> DecodeState:
    """Writes sampled ``token [batch]`` at `state.count` (as -1 for rows already done)."""
    token = jnp.where(state.done, -1, token)
    out = jax.lax.dynamic_update_slice(state.out, token[:, None], (0, state.count))
    done = state.done | jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
    return DecodeState(state.cache, token, out, state.count + 1, done)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def _prefill(
    graphdef: nnx.GraphDef,
    sampling: Sampling,
    capacity: int,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    stop_ids: jax.Array,
    key: jax.Array,
) -> DecodeState:
    """Runs the left-padded prompts ``tokens [batch, P]`` and samples the first new token."""
    forward = functools.partial(_forward, graphdef, fresh=True)
    logits, cache = interpret(forward)(params, tokens, cache)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), sampling)
    b = tokens.shape[0]
    state = DecodeState(
        cache=cache,
        token=first,
        out=jnp.full((b, capacity), -1, jnp.int32),
        count=jnp.zeros((), jnp.int32),
        done=jnp.zeros((b,), bool),
    )
    return _record(state, first, stop_ids)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode(
    graphdef: nnx.GraphDef,
    sampling: Sampling,
    params: Any,
    state: DecodeState,
    steps: jax.Array,
    limit: jax.Array,
    stop_ids: jax.Array,
    key: jax.Array,
) -> DecodeState:
    """Up to `steps` decode steps, stopping at `limit` tokens in `out` or when all rows are done."""

    def run(params, state):
        def cond(carry):
            i, s = carry
            return (i < steps) & (s.count < limit) & ~jnp.all(s.done)

        def body(carry):
            i, s = carry
            logits, cache = _forward(graphdef, params, s.token[:, None], s.cache)
            token = sample_logits(logits[:, -1], jax.random.fold_in(key, s.count), sampling)
            s = dataclasses.replace(s, cache=cache)
            return i + 1, _record(s, token, stop_ids)

        return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]

    return interpret(run)(params, state)


# The two as called from Python: each compile's freed scratch goes back to the system before
# the next program compiles (`releasing_after_compile`).
_run_prefill = releasing_after_compile(_prefill)
_run_decode = releasing_after_compile(_decode)


def _split(model: Any, params: Any) -> tuple[nnx.GraphDef, Any, nnx.Module]:
    """(graphdef, params, module) of a `Decoder`, a `QuantizedModel` or a module plus params."""
    module = getattr(model, "module", model)  # QuantizedModel wraps the module
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"model must be a flax nnx.Module (e.g. lowbit.models.Decoder) or a QuantizedModel, "
            f"got {type(model).__name__}"
        )
    graphdef, state = nnx.split(module)
    if not hasattr(module, "init_cache") or not hasattr(module, "config"):
        raise TypeError(f"model {type(module).__name__} has no KV cache (init_cache, config)")
    return graphdef, state if params is None else params, module


@dataclasses.dataclass(frozen=True)
class Generation:
    """The result of `generate_tokens`.

    Attributes:
      tokens: per row, the new token ids, without the stop token.
      stopped: per row, True when it ended at a stop token (False: `max_new_tokens` reached).
      prompt_lengths: per row, the prompt's token count.
    """

    tokens: list[list[int]]
    stopped: list[bool]
    prompt_lengths: list[int]


def _check_prompts(prompts: Sequence[Sequence[int]], context: int, max_new_tokens: int):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] has no tokens; every prompt needs at least one token")
        if len(p) + max_new_tokens > context:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model's context of {context} tokens. Shorten the prompt or lower "
                "max_new_tokens"
            )


def stream_tokens(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    params: Any = None,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    key: jax.Array | int | None = None,
    stop_ids: Sequence[int] = (),
    kv_cache: KVCacheConfig | str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    mesh: jax.sharding.Mesh | GenerationSharding | None = None,
    program_dir: str | os.PathLike[str] | None = None,
) -> Iterator[np.ndarray]:
    """Continues each of a batch of token prompts, yielding the new tokens as they come.

    Args:
      model: a `Decoder` (float), a `QuantizedModel` of one, or the float module with `params`.
      prompts: per row, the prompt's token ids (lengths may differ; none may be empty).
      params: parameters to run instead of the module's own (e.g. quantized ones from
        `quantize_params`, `import_gguf` or `load_checkpoint`).
      max_new_tokens: at most this many new tokens per row (>= 1).
      sampling: greedy by default; see `Sampling`.
      key: a `jax.random.key` or an int seed for sampling (default seed 0). Same key, same
        tokens.
      stop_ids: token ids that end a row.
      kv_cache: a quantized KV cache format (`KVCacheConfig`, ``"int8"``, ``"int4"``,
        ``"fp8"``) or None for float.
      chunk: decode steps per compiled call (None: all in one call).
      program_dir: keep the prefill and decode programs' traced form here
        (`lowbit.api.compile_stored`; `lowbit.api.program_directory()` is the one beside
        JAX's compilation cache), so that the next process generating with the same model
        and shapes does not trace them; one device only (ignored with a `mesh`).
      mesh: run on this mesh (a `jax.sharding.Mesh` with a ``"model"`` axis for tensor
        parallelism and / or a ``"data"`` axis for batch rows, or a `GenerationSharding`):
        params and KV cache are placed by `shard_for_generation` (heads and MLP columns
        split over ``"model"``, rows over ``"data"``; a batch that does not divide over
        ``"data"`` is padded with copies of its last prompt, dropped from the result).
        None: one device.
    Yields:
      ``[batch, n]`` int32 arrays of new tokens, -1 for rows that already stopped (a stop
      token is yielded, then -1s).
    Raises:
      ValueError: `max_new_tokens` < 1, an empty prompt or batch, a prompt plus
        `max_new_tokens` longer than the model's context, an unknown `kv_cache` format.
    """
    graphdef, params, module = _split(model, params)
    prompts = [list(map(int, p)) for p in prompts]
    _check_prompts(prompts, module.config.context_length, max_new_tokens)
    plan = None
    if mesh is not None:
        params, plan = shard_for_generation(params, mesh, module.config)
        graphdef = _Sharded(type(module), plan.fit(module.config), module.dtype, plan)
    n_rows = len(prompts)
    if plan is not None and n_rows % plan.dp:
        # Rows split over the data axis: repeat the last prompt to fill it (dropped below).
        prompts = prompts + [prompts[-1]] * (plan.dp - n_rows % plan.dp)
    kv = parse_kv_cache(kv_cache, "kv_cache")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 or None")
    if key is None:
        key = jax.random.key(0)
    elif isinstance(key, int):
        key = jax.random.key(key)
    stops = list(dict.fromkeys(int(s) for s in stop_ids))
    if len(stops) > _MAX_STOP_IDS:
        raise ValueError(f"stop_ids has {len(stops)} ids; at most {_MAX_STOP_IDS} are supported")
    stop_arr = jnp.asarray(stops + [-2] * (_MAX_STOP_IDS - len(stops)), jnp.int32)

    b = len(prompts)
    width = bucket(max(len(p) for p in prompts))
    tokens = np.zeros((b, width), np.int32)
    pad = np.zeros((b,), np.int32)
    for row, p in enumerate(prompts):
        pad[row] = width - len(p)
        tokens[row, pad[row] :] = p
    capacity = bucket(max_new_tokens)
    # The last new token is never fed back: the cache needs width + max_new_tokens - 1 slots.
    max_len = bucket(width + max_new_tokens - 1)
    if plan is None:
        cache = module.init_cache(b, max_len, kv)
        start, tokens = jnp.asarray(pad), jnp.asarray(tokens)
    else:
        cache = plan.init_cache(module, b, max_len, kv)
        start, tokens = put(pad, plan.rows(1)), put(tokens, plan.rows(2))
        stop_arr, key = put(stop_arr, plan.named()), put(key, plan.named())
    cache = dataclasses.replace(cache, start=start)

    limit = jnp.int32(max_new_tokens)
    steps = jnp.int32(max_new_tokens if chunk is None else chunk)
    prefill, decode = _run_prefill, _run_decode
    if program_dir is not None and plan is None:
        prefill, decode = _stored_programs(
            program_dir, graphdef, module, sampling, capacity, params, tokens, cache, stop_arr, key
        )
    if plan is None:
        graphdef = _Graph(graphdef)
    state = prefill(graphdef, sampling, capacity, params, tokens, cache, stop_arr, key)
    emitted = 0
    host = np.asarray if plan is None else fetch  # with processes: every one gathers
    while True:
        count = int(host(state.count))
        if count > emitted:
            yield host(state.out)[:n_rows, emitted:count]
            emitted = count
        if count >= max_new_tokens or bool(host(state.done)[:n_rows].all()):
            return
        state = decode(graphdef, sampling, params, state, steps, limit, stop_arr, key)


def _stored_programs(directory, graphdef, module, sampling, capacity, *args):
    """`_prefill` and `_decode` (same signatures) through `lower_stored`: their traced form
    read from `directory`, or kept there, and the two compiled at once (`compile_together`).
    The PRNG key travels as its data."""
    params, tokens, cache, stop_arr, key = args
    impl = jax.random.key_impl(key)
    static = describe((graphdef, module.config, sampling, capacity, impl))

    def first(params, tokens, cache, stop_arr, data):
        key = jax.random.wrap_key_data(data, impl=impl)
        return _prefill(graphdef, sampling, capacity, params, tokens, cache, stop_arr, key)

    data = jax.random.key_data(key)
    prefill = lower_stored(
        "generate-prefill",
        first,
        (params, tokens, cache, stop_arr, data),
        static=static,
        out_like=lambda a: DecodeState(cache=a[2], token=0, out=0, count=0, done=0),
        donate_argnums=(2,),
        directory=directory,
    )
    state = prefill.out_shapes

    def step(params, state, steps, limit, stop_arr, data):
        key = jax.random.wrap_key_data(data, impl=impl)
        return _decode(graphdef, sampling, params, state, steps, limit, stop_arr, key)

    scalar = jnp.int32(0)
    decode = lower_stored(
        "generate-decode",
        step,
        (params, state, scalar, scalar, stop_arr, data),
        static=static,
        out_like=lambda a: a[1],
        donate_argnums=(1,),
        directory=directory,
    )
    prefill, decode = compile_together([prefill, decode])

    def run_prefill(graphdef, sampling, capacity, params, tokens, cache, stop_arr, key):
        return prefill(params, tokens, cache, stop_arr, jax.random.key_data(key))

    def run_decode(graphdef, sampling, params, state, steps, limit, stop_arr, key):
        return decode(params, state, steps, limit, stop_arr, jax.random.key_data(key))

    return run_prefill, run_decode


def generate_tokens(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    on_tokens: Callable[[np.ndarray], None] | None = None,
    chunk: int | None = None,
    **options: Any,
) -> Generation:
    """Continues each of a batch of token prompts; `stream_tokens` collected.

    Args:
      model, prompts: as `stream_tokens`.
      on_tokens: called with each new ``[batch, n]`` chunk of tokens (-1 after a row stopped);
        for streaming.
      chunk: decode steps per compiled call; None runs the whole loop in one call (default,
        unless `on_tokens` is given, then `DEFAULT_CHUNK`).
      **options: `stream_tokens`' keyword arguments (`params`, `max_new_tokens`, `sampling`,
        `key`, `stop_ids`, `kv_cache`, `mesh`).
    Returns:
      A `Generation` (stop tokens are not in its rows).
    Raises:
      As `stream_tokens`.
    """
    if on_tokens is not None and chunk is None:
        chunk = DEFAULT_CHUNK
    b = len(prompts)
    rows: list[list[int]] = [[] for _ in range(b)]
    stopped = [False] * b
    stop_set = set(int(s) for s in options.get("stop_ids", ()))
    for new in stream_tokens(model, prompts, chunk=chunk, **options):
        for row in range(b):
            for t in new[row]:
                if stopped[row] or t < 0:
                    break
                if int(t) in stop_set:
                    stopped[row] = True
                    break
                rows[row].append(int(t))
        if on_tokens is not None:
            on_tokens(new)
    return Generation(tokens=rows, stopped=stopped, prompt_lengths=[len(p) for p in prompts])


def stop_token_ids(tokenizer: Any, stop_tokens: Sequence[str]) -> list[int]:
    """Ids of the `stop_tokens` the tokenizer knows (unknown ones are skipped)."""
    ids = (tokenizer.token_to_id(t) for t in stop_tokens)
    return [i for i in ids if i is not None]


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[str],
    *,
    params: Any = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    key: jax.Array | int | None = None,
    stop_tokens: Sequence[str] = DEFAULT_STOP_TOKENS,
    kv_cache: KVCacheConfig | str | None = None,
    mesh: jax.sharding.Mesh | GenerationSharding | None = None,
) -> str | list[str]:
    """`lowbit.generate`: continue a text prompt (or a list of them, run as one batch).

    Args:
      model, params, max_new_tokens, key, kv_cache, mesh: as in `generate_tokens`.
      tokenizer: a `tokenizers.Tokenizer` (e.g. from `load_smollm2`).
      prompt: the prompt text, already formatted (e.g. by `chat_prompt`), or a list of them.
      temperature, top_k, top_p: sampling (`Sampling`); temperature 0 is greedy.
      stop_tokens: token strings that end a row (not included in the text).
    Returns:
      The new text (special tokens dropped): a str for a str prompt, else a list.

    Example:
      >>> model, tok = lowbit.models.load_smollm2()
      >>> lowbit.generate(model, tok, chat_prompt("What is the capital of France?"),
      ...                 max_new_tokens=16)
      'The capital of France is Paris.'
    """
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [tokenizer.encode(t).ids for t in texts]
    for i, row in enumerate(ids):
        if not row:
            name = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
            raise ValueError(f"{name} encodes to no tokens; give a non-empty prompt")
    result = generate_tokens(
        model,
        ids,
        params=params,
        max_new_tokens=max_new_tokens,
        sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p),
        key=key,
        stop_ids=stop_token_ids(tokenizer, stop_tokens),
        kv_cache=kv_cache,
        mesh=mesh,
    )
    out = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    return out[0] if isinstance(prompt, str) else out


def generate_greedy(
    model: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[str] = DEFAULT_STOP_TOKENS,
) -> str:
    """Greedy continuation of `prompt` (`generate` with temperature 0)."""
    return generate(
        model, tokenizer, prompt, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens
    )
