"""Seed inputs built from the real files lowbit ships with (SmolLM2's GGUF, MiniLM's
safetensors) and from files lowbit writes, small enough to fuzz fast."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator

import numpy as np

Seed = tuple[str, bytes]

# Keeps seeds, and so the inputs the fuzzer grows from them, small: exec/s falls with size.
_VOCAB = 48


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _gguf_writer_bytes(fill) -> bytes:
    """The bytes of a GGUF file written by the `gguf` package's writer; `fill(writer)` adds
    metadata and tensors."""
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seed.gguf")
        writer = gguf.GGUFWriter(path, "llama")
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return _read(path)


def _small_smollm2(writer) -> None:
    """SmolLM2's metadata with its vocabulary cut to `_VOCAB` tokens, a few of its tensors cut
    to a few rows (blocks kept as stored), and tensors of the other block types."""
    import gguf

    from lowbit.gguf import encode as gguf_encode
    from lowbit.gguf import read_gguf
    from lowbit.models._assets import smollm2_gguf_path

    source = read_gguf(smollm2_gguf_path())
    for key, value in source.metadata.items():
        if key in ("general.architecture", "general.alignment"):
            continue
        if isinstance(value, list):
            value = value[:_VOCAB]
        if key == "tokenizer.chat_template":
            value = value[:80]
        _add(writer, key, value)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_down.weight"):
        t = source.tensor(name)
        raw = np.ascontiguousarray(t.raw[:2] if t.raw.ndim > 1 else t.raw[:32])
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t.ggml_type)
    rng = np.random.default_rng(0)
    for type_name in ("Q4_K", "Q6_K", "Q5_0", "IQ4_NL", "Q2_K"):
        block = 256 if type_name.endswith("_K") else 32
        raw = gguf_encode(type_name, rng.standard_normal((2, block)).astype(np.float32))
        kind = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(f"x.{type_name.lower()}", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.add_tensor("x.f16", rng.standard_normal((2, 8)).astype(np.float16))


def _add(writer, key, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2**32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _every_value_type(writer) -> None:
    """One metadata key of each GGUF value type, nested arrays included, and an f32 tensor."""
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", -2.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.arr_i", [1, 2, 3])
    writer.add_array("t.arr_f", [0.5, -1.0])
    writer.add_array("t.arr_s", ["a", "bc"])
    writer.add_array("t.arr_nested", [[1, 2], [3]])
    writer.add_uint32("general.alignment", 64)
    writer.add_tensor("w", np.arange(8, dtype=np.float32).reshape(2, 4))


def gguf_seeds() -> Iterator[Seed]:
    from lowbit.models._assets import smollm2_gguf_path

    small = _gguf_writer_bytes(_small_smollm2)
    yield "smollm2_small.gguf", small
    yield "every_value_type.gguf", _gguf_writer_bytes(_every_value_type)
    yield "smollm2_head_4k.gguf", _read(str(smollm2_gguf_path()))[:4096]
    yield "smollm2_small_truncated.gguf", small[: len(small) * 2 // 3]
    yield from hostile_gguf_seeds()


def _gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _tiny_llama(block_count: int, **widths: int):
    """A whole two-layer Llama (no tokenizer) whose metadata declares `block_count` layers and
    the given widths: the cost of a file's declarations must follow the file, not them."""

    def fill(writer) -> None:
        dim, ffn, heads, vocab = 16, 32, 2, 8
        metadata = {"block_count": block_count, "embedding_length": dim}
        metadata |= {"feed_forward_length": ffn, "attention.head_count": heads, **widths}
        for key, value in metadata.items():
            writer.add_uint32(f"llama.{key}", value)
        rng = np.random.default_rng(0)

        def tensor(name, *shape):
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

        tensor("token_embd.weight", vocab, dim)
        tensor("output_norm.weight", dim)
        for i in range(2):
            for name, shape in (
                ("attn_norm", (dim,)),
                ("ffn_norm", (dim,)),
                ("attn_q", (dim, dim)),
                ("attn_k", (dim, dim)),
                ("attn_v", (dim, dim)),
                ("attn_output", (dim, dim)),
                ("ffn_gate", (ffn, dim)),
                ("ffn_up", (ffn, dim)),
                ("ffn_down", (dim, ffn)),
            ):
                tensor(f"blk.{i}.{name}.weight", *shape)

    return fill


def hostile_gguf_seeds() -> Iterator[Seed]:
    """Small files declaring counts and sizes far beyond what they hold: tensors, metadata
    keys, string and array lengths, tensor dimensions, layers and widths. Each must be refused
    at a cost in proportion to the file (`fuzz._bounded`)."""
    yield "hostile_tensor_count.gguf", _gguf_header(2**40, 0) + bytes(64)
    yield "hostile_kv_count.gguf", _gguf_header(0, 2**40) + bytes(64)
    key = _gguf_string("general.name")
    yield (
        "hostile_string_length.gguf",
        (_gguf_header(0, 1) + key + struct.pack("<IQ", 8, 2**62) + b"x" * 64),
    )
    yield (
        "hostile_array_length.gguf",
        (_gguf_header(0, 1) + key + struct.pack("<IIQ", 9, 0, 2**60) + bytes(64)),
    )
    yield (
        "hostile_nested_array_length.gguf",
        (_gguf_header(0, 1) + key + struct.pack("<IIQ", 9, 9, 2**40) + bytes(64)),
    )
    info = _gguf_string("w") + struct.pack("<IQQIQ", 2, 2**40, 2**40, 0, 0)
    yield "hostile_tensor_dims.gguf", _gguf_header(1, 0) + info + bytes(64)
    yield "hostile_block_count.gguf", _gguf_writer_bytes(_tiny_llama(10**9))
    yield "hostile_width.gguf", _gguf_writer_bytes(_tiny_llama(2, embedding_length=10**9))
    heads = {"attention.head_count": 2**31}
    yield "hostile_heads.gguf", _gguf_writer_bytes(_tiny_llama(2, **heads))


def safetensors_seeds() -> Iterator[Seed]:
    """MiniLM's first tensors cut to a few rows, a lowbit checkpoint's tensor file, and a file
    of every dtype the format has."""
    import ml_dtypes
    import safetensors.numpy

    from lowbit.io._safetensors_file import read_header, read_tensor, write_safetensors
    from lowbit.models._assets import minilm_dir

    path = str(minilm_dir() / "model.safetensors")
    tensors = {}
    with open(path, "rb") as f:
        for name, entry in list(read_header(path).items())[:6]:
            array = read_tensor(f, entry)
            tensors[name] = np.ascontiguousarray(array[:2, :8] if array.ndim == 2 else array[:8])
    yield "minilm_small.safetensors", safetensors.numpy.save(tensors, metadata={"format": "pt"})
    dtypes = {
        "b": np.array([True, False]),
        "u8": np.arange(3, dtype=np.uint8),
        "i16": np.arange(3, dtype=np.int16),
        "f16": np.ones((2, 2), np.float16),
        "bf16": np.ones(2, ml_dtypes.bfloat16),
        "f8": np.ones(2, ml_dtypes.float8_e4m3fn),
        "f64": np.zeros((1, 1, 2)),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(3.0, np.float32),
    }
    yield "every_dtype.safetensors", safetensors.numpy.save(dtypes)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(tmp)
        yield "checkpoint.safetensors", _read(os.path.join(checkpoint, "model.safetensors"))
        write_safetensors(os.path.join(tmp, "plain.safetensors"), {"x": np.ones(4, np.int32)})
        yield "plain.safetensors", _read(os.path.join(tmp, "plain.safetensors"))
    yield from hostile_safetensors_seeds()


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def hostile_safetensors_seeds() -> Iterator[Seed]:
    """Headers declaring sizes far beyond the file: a header length, a shape, a byte range."""
    yield "hostile_header_length.safetensors", struct.pack("<Q", 2**62) + b"{}"
    yield (
        "hostile_shape.safetensors",
        _safetensors(
            {"w": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 16]}}, bytes(16)
        ),
    )
    yield (
        "hostile_offsets.safetensors",
        _safetensors(
            {"w": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}, bytes(16)
        ),
    )
    many = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(2000)}
    yield "hostile_many_empty_tensors.safetensors", _safetensors(many)


def _checkpoint(directory: str) -> str:
    """A small checkpoint written by lowbit: every node kind and several QArray formats."""
    import jax.numpy as jnp

    from lowbit.io import save_checkpoint
    from lowbit.qarray import PerGroup, quantize
    from lowbit.recipes import preset

    x = jnp.linspace(-1.0, 1.0, 64 * 8, dtype=jnp.float32).reshape(64, 8)
    tree = {
        "int4": quantize(x, "int4", granularity=PerGroup(32)),
        "uint4": quantize(x, "uint4"),
        "nf4": quantize(x, "nf4"),
        "mxfp4": quantize(x.T, "mxfp4"),
        "bias": np.arange(4, dtype=np.float32),
        "layers": [{"scale": 1.5, "on": True}, None, (np.ones(2, ml_bf16()), 3)],
    }
    path = os.path.join(directory, "ckpt")
    save_checkpoint(path, tree, recipe=preset("int4_weight_only"), metadata={"note": "seed"})
    return path


def ml_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def manifest_seeds() -> Iterator[Seed]:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(tmp)
        raw = _read(os.path.join(checkpoint, "manifest.json"))
    yield "checkpoint_manifest.json", raw
    manifest = json.loads(raw)
    yield "compact_manifest.json", json.dumps(manifest, separators=(",", ":")).encode()
    manifest["format_version"] = 1
    yield "version1_manifest.json", json.dumps(manifest).encode()


def recipe_seeds() -> Iterator[Seed]:
    from lowbit.recipes import preset, preset_names

    for name in preset_names():
        try:
            yield f"preset_{name}.json", preset(name).to_json().encode()
        except (TypeError, ValueError):  # presets that need arguments (intmp)
            continue
    # A plan as `lowbit quantize --bits` writes it: exact paths, shapes recorded.
    from lowbit.recipes import parse_candidate, plan_recipe

    plan = plan_recipe(
        {
            "layers/0/mlp/up/kernel": (parse_candidate("int4:g64:gptq"), (576, 1536)),
            "layers/0/attn/v_proj/kernel": (parse_candidate("int8"), (576, 192)),
            "output/kernel": (parse_candidate("q6_k"), (576, 49152)),
        }
    )
    yield "plan.json", plan.to_json().encode()
    intmp = {"default": {"w_bits": 8, "a_bits": 8}, ".*attn.*": {"w_bits": 4, "tile_size": 128}}
    yield "maxtext_intmp.json", json.dumps(intmp).encode()


def tokenizer_seeds() -> Iterator[Seed]:
    """Byte strings the structured harness reads as choices: a few fixed patterns."""
    rng = np.random.default_rng(0)
    for i in range(8):
        yield f"random_{i}.bin", rng.integers(0, 256, 64 + 64 * i, dtype=np.uint8).tobytes()
