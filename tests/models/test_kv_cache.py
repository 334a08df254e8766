"""Quantized KV cache: codes and scales against NumPy / ml_dtypes, memory, attention through it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from compiled import compiled
from flax import nnx

from lowbit.models import Decoder, DecoderConfig, dequantize_kv, init_kv_cache, quantize_kv
from lowbit.models._kv_cache import hadamard, unpack_int4
from lowbit.recipes import KVCacheConfig, Recipe, parse_kv_cache

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 5, 16)).astype(np.float32) * np.linspace(0.1, 4, 16)


def _config(text):
    return parse_kv_cache(text)


@pytest.mark.parametrize("text", ["int8", "int4", "int8:g4", "int4:g4"])
def test_integer_codes_match_numpy(text):
    config = _config(text)
    codes, scales = quantize_kv(jnp.asarray(X), config)
    group = config.group_size or X.shape[-1]
    g = X.reshape(*X.shape[:-1], -1, group)
    if config.format == "int8":
        scale = (np.abs(g).max(-1, keepdims=True) / 127).astype(np.float16)
        expected = np.clip(np.round(g / scale.astype(np.float32)), -127, 127)
        offset = 0.0
    else:  # 16 levels: code c stands for (c + 1/2) * scale
        scale = (np.abs(g).max(-1, keepdims=True) / 8).astype(np.float16)
        expected = np.clip(np.floor(g / scale.astype(np.float32)), -8, 7)
        offset = 0.5
    got = unpack_int4(codes) if config.format == "int4" else codes
    np.testing.assert_array_equal(np.asarray(got), expected.reshape(X.shape))
    np.testing.assert_array_equal(np.asarray(scales), scale[..., 0])
    back = np.asarray(dequantize_kv(codes, scales, config, jnp.float32))
    np.testing.assert_allclose(
        back, ((expected + offset) * scale.astype(np.float32)).reshape(X.shape), rtol=1e-6
    )
    # At most half a step per element (plus the float16 rounding of the scale at the clip).
    step = np.repeat(scale[..., 0].astype(np.float32), group, -1)
    assert np.all(np.abs(back - X) <= 0.51 * step)


def test_hadamard_is_orthogonal_and_its_own_inverse():
    h = hadamard(64)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)


def test_int4_packs_two_codes_a_byte():
    codes, _ = quantize_kv(jnp.asarray(X), _config("int4"))
    assert codes.dtype == jnp.uint8 and codes.shape == (*X.shape[:-1], X.shape[-1] // 2)


def test_fp8_codes_match_ml_dtypes():
    codes, scales = quantize_kv(jnp.asarray(X), _config("fp8"))
    scale = (np.abs(X).max(-1, keepdims=True) / 448.0).astype(np.float16).astype(np.float32)
    expected = (X / scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), expected.view(np.uint8))


def test_zero_and_tiny_rows_get_finite_scales():
    x = jnp.zeros((1, 1, 2, 8)).at[0, 0, 1].set(1e-30)
    for text in ("int8", "int4", "fp8"):
        codes, scales = quantize_kv(x, _config(text))
        back = dequantize_kv(codes, scales, _config(text), jnp.float32)
        assert np.all(np.isfinite(np.asarray(scales, np.float32))) and np.all(scales > 0)
        assert np.all(np.isfinite(np.asarray(back)))


@pytest.mark.parametrize(
    "text, bound",
    [("int8", 0.26), ("fp8", 0.26), ("int4", 0.15), ("float16", 0.5), ("bfloat16", 0.5)],
)
def test_cache_bytes_against_float32_at_smollm2_shapes(text, bound):
    config = DecoderConfig()
    nbytes = lambda kv: init_kv_cache(config, 1, 512, jnp.float32, kv).nbytes()  # noqa: E731
    assert nbytes(text) / nbytes(None) <= bound


@pytest.mark.parametrize("text", [None, "int8", "int4:g4", "float16"])
def test_an_empty_cache_has_a_buffer_for_each_array_and_its_fill(text):
    # The buffers come from one program; the decode loop donates each one on its own.
    cache = init_kv_cache(DecoderConfig(n_layers=3), 2, 32, jnp.float32, text)
    leaves = jax.tree.leaves(cache)
    assert len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves)
    assert len(cache.keys) == len(cache.values) == 3
    assert all(not np.asarray(x).any() for x in cache.keys + cache.values + cache.key_offsets)
    assert all((np.asarray(x) == 1).all() for x in cache.key_scales + cache.value_scales)
    assert len(cache.key_scales) == (0 if text in (None, "float16") else 3)
    assert int(cache.length) == 0 and cache.start.shape == (2,) and not cache.start.any()


@pytest.mark.parametrize(
    "text", ["int8", "int8+qk", "fp8", "int4", "int4:g4", "float16", "bfloat16"]
)
def test_attention_through_a_quantized_cache_stays_close(text):
    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(RNG.integers(0, 64, (2, 12)), jnp.int32)
    forward = compiled(model)
    ref = forward(tokens)
    logits, cache = forward(tokens, cache=model.init_cache(2, 16, text))
    assert cache.config == _config(text) and int(cache.length) == 12
    err = float(jnp.max(jnp.abs(logits - ref)) / jnp.max(jnp.abs(ref)))
    assert err < {"int4": 0.3, "int4:g4": 0.3, "fp8": 0.05, "float16": 2e-3}.get(text, 0.02), err
    assert err > 0  # the cache really was quantized (or rounded)
    if cache.config.is_float:  # plain values of that dtype: no scales, no key offsets
        assert cache.keys[0].dtype == jnp.dtype(text) and cache.key_scales == ()
        assert cache.key_offsets == ()


def test_recipe_kv_cache_round_trips_through_json():
    recipe = Recipe(rules=(), name="r", kv_cache="int4:g32")
    assert recipe.kv_cache == KVCacheConfig(format="int4", group_size=32)
    back = Recipe.from_json(recipe.to_json())
    assert back == recipe and back.kv_cache.to_text() == "int4:g32"
    assert Recipe.from_json(Recipe(rules=(), name="r").to_json()).kv_cache is None


@pytest.mark.parametrize("text", ["int3", "int4:32", "fp8+qk", "int4:g3", 8, "float16:g8", "bf16"])
def test_unknown_kv_formats_name_the_field(text):
    with pytest.raises(ValueError, match="kv_cache"):
        Recipe.from_json({"name": "r", "rules": [], "kv_cache": text})


def test_float16_cache_clips_to_its_range():
    # Keys or values beyond float16's range are stored as its largest finite value: the cache
    # never holds inf (whose scores would give NaN).
    kv = init_kv_cache(
        DecoderConfig(n_layers=1, n_kv_heads=1, head_dim=4), 1, 4, jnp.float32, "float16"
    )
    big = jnp.full((1, 1, 1, 4), 1e6, jnp.float32)
    layer = kv.layer(0).write(big, -big, jnp.int32(0))
    assert float(layer.keys[0, 0, 0, 0]) == float(jnp.finfo(jnp.float16).max)
    assert float(layer.values[0, 0, 0, 0]) == -float(jnp.finfo(jnp.float16).max)


def test_cache_is_a_pytree_with_static_config():
    cache = init_kv_cache(DecoderConfig(n_layers=2), 1, 8, jnp.float32, "int8")
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 5 * 2 + 2  # codes, scales (keys and values), key offsets; length, start
    assert jax.tree.unflatten(treedef, leaves).config == cache.config


def _decode_after_prompt(model, text, start, prompt, steps):
    """Logits [2, S, vocab] of `steps` [2, S] decoded one token at a time after `prompt`
    [2, P], in a 64-slot cache of format `text` whose rows begin at slots `start`."""
    cache = model.init_cache(2, 64, text)
    cache = dataclasses.replace(cache, start=jnp.asarray(start, jnp.int32))
    forward = compiled(model)
    _, cache = forward(prompt, cache=cache)
    out = []
    for i in range(steps.shape[1]):
        logits, cache = forward(steps[:, i : i + 1], cache=cache)
        out.append(logits)
    return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("text", [None, "int8", "int8+qk", "fp8", "int4"])
def test_decode_reads_only_filled_blocks_and_matches_all_slots(text, monkeypatch):
    # Left-padded rows (start > 0) and a token crossing a block boundary: block attention
    # over slots start..slot gives what attention over every slot with a mask gives.
    from lowbit.models import _decoder

    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(2))
    prompt = jnp.asarray(RNG.integers(0, 64, (2, 30)), jnp.int32)
    steps = jnp.asarray(RNG.integers(0, 64, (2, 4)), jnp.int32)

    run = lambda: _decode_after_prompt(model, text, [0, 5], prompt, steps)
    assert _decoder.decode_block(64) == 32
    blocks = run()
    monkeypatch.setattr(_decoder, "decode_block", lambda max_len: None)
    every = run()
    np.testing.assert_allclose(np.asarray(blocks), np.asarray(every), rtol=2e-5, atol=2e-5)


def _kernel_then_loop(monkeypatch, head_dim, text, dtype=jnp.float32):
    """Logits of three decode steps through the CPU kernel, then through the XLA block loop,
    and the cache dtypes the kernel was called with (a model of `dtype`, cache `text`)."""
    from lowbit import kernels
    from lowbit.models import _attention

    if not kernels.available():
        pytest.skip(kernels.status())
    config = DecoderConfig(
        vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=head_dim, ffn_dim=64
    )
    model = Decoder(config, dtype=dtype, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(head_dim)  # the same draw whatever ran before
    prompt = jnp.asarray(rng.integers(0, 64, (2, 30)), jnp.int32)
    steps = jnp.asarray(rng.integers(0, 64, (2, 3)), jnp.int32)

    run = lambda: _decode_after_prompt(model, text, [0, 7], prompt, steps)
    calls = []
    real = kernels.decode_attention
    monkeypatch.setattr(
        kernels, "decode_attention", lambda *a, **kw: calls.append(a[1].dtype) or real(*a, **kw)
    )
    fused = run()
    monkeypatch.setattr(_attention, "uses_fused_decode", lambda q, kv: False)
    return fused, run(), calls


@pytest.mark.parametrize(
    "head_dim, text",
    [
        (8, None),
        (32, None),
        (32, "int8"),
        (32, "int4"),
        (32, "fp8:g16"),
        (32, "int8:g16+qk"),
        (32, "float16"),
        (32, "bfloat16"),
    ],
)
def test_fused_decode_kernel_matches_the_block_loop(head_dim, text, monkeypatch):
    # On the CPU a decode step reads the cache (float32; float16 / bfloat16 widened as loaded;
    # int8 / int4 / fp8 dequantized a chunk at a time; int8 keys by integer products) in one
    # kernel call per layer (`lowbit.kernels.decode_attention`); the XLA block loop must give
    # the same logits.
    fused, loop, calls = _kernel_then_loop(monkeypatch, head_dim, text)
    assert calls, f"the {text or 'float32'} cache did not take the kernel"
    # The same float32 arithmetic in another order (chunked online softmax against the block
    # loop): float32 caches agree within 2e-5; over 16-bit ones a few logits moved by up to
    # 6e-5 on other draws.
    tol = 2e-4 if text in ("float16", "bfloat16") else 2e-5
    np.testing.assert_allclose(np.asarray(fused), np.asarray(loop), rtol=tol, atol=tol)


def test_bfloat16_model_decodes_through_the_kernel(monkeypatch):
    # A bfloat16 model's cache is bfloat16: the kernel reads it in place (widened as loaded,
    # queries widened to float32), where the block loop takes bfloat16 score products; the
    # logits agree to bfloat16's resolution.
    fused, loop, calls = _kernel_then_loop(monkeypatch, 32, None, jnp.bfloat16)
    assert calls and all(d == jnp.bfloat16 for d in calls), calls
    assert fused.dtype == loop.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(fused, np.float32), np.asarray(loop, np.float32), rtol=0.05, atol=0.05
    )


def test_last_only_logits_are_the_last_position():
    # Generation samples from the last position only; computing just that row must give the
    # same logits and the same cache as the full forward.
    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(4))
    prompt = jnp.asarray(RNG.integers(0, 64, (2, 9)), jnp.int32)
    forward = compiled(model)
    full, cache_full = forward(prompt, cache=model.init_cache(2, 16))
    last, cache_last = forward(prompt, cache=model.init_cache(2, 16), last_only=True)
    assert last.shape == (2, 1, 64)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -1:]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cache_last.keys[1]), np.asarray(cache_full.keys[1]))


def _three_rows(fused, monkeypatch, seed, text):
    """A two-layer model, an rng, a [3, 20] prompt and an empty 64-slot cache of 3 rows that
    start at slots 0, 4 and 9; without `fused` attention runs as the XLA block loop."""
    from lowbit.models import _attention

    if not fused:
        monkeypatch.setattr(_attention, "uses_fused_decode", lambda q, kv: False)
    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, 64, (3, 20)), jnp.int32)
    cache = model.init_cache(3, 64, text)
    return model, rng, prompt, dataclasses.replace(cache, start=jnp.asarray([0, 4, 9], jnp.int32))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("text", [None, "int8", "int4"])
def test_decoding_some_rows_in_place_matches_decoding_all(text, fused, monkeypatch):
    # A cache with `rows` decodes those rows only, reading and writing them in place: their
    # logits and slots are the full step's, every other row's slots stay as they were (the
    # CPU kernel and the XLA block loop alike).
    model, rng, prompt, cache = _three_rows(fused, monkeypatch, 5, text)
    steps = jnp.asarray(rng.integers(0, 64, (3, 3)), jnp.int32)
    forward = compiled(model)
    _, cache = forward(prompt, cache=cache)
    rows = jnp.asarray([2, 0], jnp.int32)
    full, some = cache, dataclasses.replace(cache, rows=rows)
    for i in range(steps.shape[1]):
        want, full = forward(steps[:, i : i + 1], cache=full)
        got, some = forward(steps[rows, i : i + 1], cache=some)
        # int4's Hadamard rotation is a product whose rounding may follow the batch size.
        tol = 1e-5 if text == "int4" else 0.0
        want = np.asarray(want)[np.asarray(rows)]
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    assert some.rows is not None
    some = dataclasses.replace(some, rows=None)
    leaves = zip(*map(jax.tree.leaves, (some, full, cache)), strict=True)
    for a, b, before in leaves:
        if a.ndim < 2:  # length, start
            continue
        if text != "int4":
            np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]])
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(before)[1])
    assert int(some.length) == int(full.length) == 23


@pytest.mark.parametrize(("fused", "tokens"), [(True, 3), (False, 3), (True, 12), (False, 12)])
def test_some_rows_take_several_tokens_in_place_as_the_whole_cache_does(fused, tokens, monkeypatch):
    # A speculative check (3 tokens, unrolled) or a draft model's window (12, a loop) on rows
    # 2 and 0 in place, one decode-attention call per token, against the whole cache's causal
    # attention over the same tokens.
    model, rng, prompt, cache = _three_rows(fused, monkeypatch, 6, None)
    check = jnp.asarray(rng.integers(0, 64, (3, tokens)), jnp.int32)
    forward = compiled(model)
    _, cache = forward(prompt, cache=cache)
    rows = jnp.asarray([2, 0], jnp.int32)
    want, full = forward(check, cache=cache)
    got, some = forward(check[rows], cache=dataclasses.replace(cache, rows=rows))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[[2, 0]], rtol=1e-5, atol=1e-5)
    some = dataclasses.replace(some, rows=None)
    assert int(some.length) == int(full.length) == 20 + tokens
    for a, b, before in zip(*map(jax.tree.leaves, (some, full, cache)), strict=True):
        if a.ndim < 2:
            continue
        np.testing.assert_allclose(
            np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(before)[1])


def test_a_window_of_tokens_on_some_rows_runs_as_a_loop_the_same_size_for_any_count():
    # A draft model is fed windows of up to 64 tokens on some rows: unrolled, each token's
    # decode-attention call was its own ops, and SmolLM2's 64-token window compiled in 60 s.
    # Past `UNROLLED_TOKENS` the program is the same for 16 tokens as for 64.
    from lowbit.models._decoder import UNROLLED_TOKENS

    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(4))
    cache = dataclasses.replace(model.init_cache(3, 128), rows=jnp.asarray([2], jnp.int32))

    def operations(tokens: int) -> int:
        lowered = nnx.jit(lambda m, x, c: m(x, cache=c)).lower(
            model, jnp.zeros((1, tokens), jnp.int32), cache
        )
        return len(lowered.as_text().splitlines())  # a line per operation

    assert UNROLLED_TOKENS < 16
    assert operations(16) == operations(64)


@pytest.mark.parametrize("kv_cache", ["float16", "int8"])
def test_decoding_more_rows_in_place_is_the_same_program_size(kv_cache):
    # Each row's write was its own in-place update: the server's 16-row decode of SmolLM2
    # held 960 and compiled in about twice the time (`python -m benchmarks decode_rows`). The
    # rows' writes are one scatter a buffer, so the program is the same size for 2 rows as 16.
    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(4))

    def operations(rows: int) -> int:
        cache = model.init_cache(32, 64, kv_cache=kv_cache)
        cache = dataclasses.replace(cache, rows=jnp.arange(rows, dtype=jnp.int32))
        lowered = nnx.jit(lambda m, x, c: m(x, cache=c)).lower(
            model, jnp.zeros((rows, 1), jnp.int32), cache
        )
        return len(lowered.as_text().splitlines())  # a line per operation

    assert operations(2) == operations(16)


def test_rows_need_a_cache_with_decode_blocks():
    config = DecoderConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(4))
    cache = dataclasses.replace(model.init_cache(3, 48), rows=jnp.asarray([1], jnp.int32))
    with pytest.raises(ValueError, match="multiple of 32 slots"):
        model(jnp.zeros((1, 2), jnp.int32), cache=cache)
