"""QuaRot-style rotations of a decoder's float parameters that leave its function unchanged.

Two offline rotations, each an exact identity on the float model:

* **Residual stream.** With ``Q`` orthogonal, every RMSNorm without its scale commutes with it
  (``rms(xQ) = rms(x)``). So, after folding each norm's scale into the linear layers it feeds
  (``W ← diag(s) W``: q/k/v or qkv, gate/up or gate_up, the MoE router, experts and shared
  expert, the output head), the residual stream can live rotated: the embedding and every
  layer writing into the stream (o_proj, down_proj) multiply their outputs by ``Q``, every
  layer reading from it takes ``Qᵀ W``. ``Q = diag(±1) H`` (random signs, `hadamard_matrix`).
  The folded head differs from the embedding, so a tied model comes back untied, with an
  explicit ``lm_head``.
* **Per head, values.** v_proj's outputs of each key/value head and o_proj's inputs of every
  query head reading it are rotated by ``R`` (Hadamard of head_dim): attention mixes values
  linearly per head, so ``(Σ p v R) Rᵀ = Σ p v``. Exact with grouped queries and v biases.
  ``R = H diag(±1)`` (random signs): an int4 KV cache rotates values by ``H`` once more.

What a fold cannot prove exact is refused: a norm on a sub-block's output (Gemma 2/3's
post-norms) with a per-channel scale does not commute with ``Q``. The residual rotation is
then left off for the whole model (it is one rotation of one stream), named in the report;
`strict` raises instead.

Also here, for the online rotation of down_proj's input: `rotate_down_inputs` stores
``Hᵀ W_down`` and says which weights need ``x ↦ x H`` at run time (`lowbit.ops`' engine value).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.models._decoder import Decoder
from lowbit.models._decoder_config import DecoderConfig
from lowbit.ops import hadamard_matrix, hadamard_transform
from lowbit.recipes import RotationConfig


@dataclasses.dataclass(frozen=True)
class RotationReport:
    """What `rotate_decoder` did.

    Attributes:
      rotated: the rotations applied (``"residual"``, ``"heads"``).
      folded: norm scales folded into the layers they feed (parameter paths).
      skipped: ``{path: why}`` for what was left unrotated.
      untied: the tied embedding became an explicit ``lm_head``.
    """

    rotated: tuple[str, ...]
    folded: tuple[str, ...]
    skipped: dict[str, str]
    untied: bool

    def lines(self) -> list[str]:
        out = [f"rotated: {', '.join(self.rotated) or 'nothing'}"]
        if self.untied:
            out.append("untied: the output head is now lm_head/kernel (the folded final norm)")
        out += [f"left unrotated: {path}: {why}" for path, why in self.skipped.items()]
        return out


class RotationError(ValueError):
    """A strict rotation met a layer the fold cannot prove exact."""


def _signs(dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=dim)


def _uniform(scale: np.ndarray) -> bool:
    return bool(np.all(scale == scale.reshape(-1)[0]))


def _residual_blockers(config: DecoderConfig, params: dict) -> dict[str, str]:
    """``{path: why}`` of the layers that keep the residual rotation from being exact."""
    blockers = {}
    if config.dim % 2:
        blockers["embed/embedding"] = (
            f"dim={config.dim} has no power-of-two factor for a Hadamard rotation"
        )
    if config.post_norms:
        for i, layer in params["layers"].items():
            for name in ("post_attn_norm", "post_mlp_norm"):
                if not _uniform(np.asarray(layer[name]["scale"])):
                    blockers[f"layers/{i}/{name}/scale"] = (
                        "a norm on a sub-block's output with a per-channel scale does not "
                        "commute with the residual rotation (Gemma 2/3 post-norms); the residual "
                        "stream is left unrotated"
                    )
    return blockers


def _cast(x: Any, like: Any) -> Any:
    return np.asarray(x, dtype=np.asarray(like).dtype)


# The rotation's arithmetic: float32 (float64 for float64 weights), by the fast transform.
def _work(w: Any) -> jax.Array:
    dtype = jnp.float64 if np.asarray(w).dtype == np.float64 else jnp.float32
    return jnp.asarray(w, dtype)


# Each weight's rotation is one compiled program a shape: run op by op, the transform's
# log2(dim) butterfly passes would each be compiled and dispatched on their own (SmolLM2-135M's
# rotations took 9.6 s that way).
@jax.jit
def _rows_rotated(a: jax.Array, row_scale: jax.Array) -> jax.Array:
    """``Hᵀ diag(row_scale) A`` for ``A [..., dim, out]``."""
    a = a * row_scale[:, None]
    return jnp.swapaxes(hadamard_transform(jnp.swapaxes(a, -1, -2)), -1, -2)


@jax.jit
def _columns_rotated(a: jax.Array, column_scale: jax.Array) -> jax.Array:
    """``A diag(column_scale) H`` for ``A [..., in, dim]``."""
    return hadamard_transform(a * column_scale)


def _fold_in(w: Any, scale: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``Qᵀ diag(scale) W`` for ``W [..., dim, out]`` (experts lead with ``n_experts``), with
    ``Q = diag(signs) H``: ``(Qᵀ A)ᵀ = Aᵀ diag(signs) H``."""
    a = _work(w)
    return _cast(_rows_rotated(a, jnp.asarray(scale * signs, a.dtype)), w)


def _rotate_out(w: Any, signs: np.ndarray) -> np.ndarray:
    """``W Q = (W diag(signs)) H`` for ``W [..., in, dim]``."""
    a = _work(w)
    return _cast(_columns_rotated(a, jnp.asarray(signs, a.dtype)), w)


def rotate_decoder(
    config: DecoderConfig, params: dict, rotation: RotationConfig | None = None
) -> tuple[DecoderConfig, dict, RotationReport]:
    """The offline rotations (`RotationConfig.residual`, `.heads`) of a decoder's float params.

    Args:
      config: the decoder's config.
      params: its float parameters as a pure dict (``nnx.to_pure_dict``), not modified.
      rotation: which rotations (default: both); `online` is not applied here
        (`rotate_down_inputs`).
    Returns:
      ``(config, params, report)``: the config (untied when the residual rotation folded a
      tied head), new params computing the same logits up to float rounding, and what was done.
    Raises:
      RotationError: in strict mode, naming the layer the fold cannot prove exact.
    """
    rotation = rotation or RotationConfig()
    c = config
    skipped: dict[str, str] = {}
    rotated: list[str] = []
    folded: list[str] = []
    new = _copy(params)
    untied = False
    if rotation.residual:
        blockers = _residual_blockers(c, params)
        if blockers and rotation.strict:
            path, why = next(iter(blockers.items()))
            raise RotationError(
                f"rotate: {path}: {why}. Use a non-strict rotation to leave it unrotated, or "
                "rotate='hadamard' without the residual stream (RotationConfig(residual=False))"
            )
        skipped.update(blockers)
        if not blockers:
            q = _signs(c.dim, rotation.seed)
            untied = _rotate_residual(c, new, q, folded)
            rotated.append("residual")
    if rotation.heads:
        if c.head_dim % 2:
            why = f"head_dim={c.head_dim} has no power-of-two factor"
            if rotation.strict:
                raise RotationError(f"rotate: layers/*/attn/v_proj: {why}")
            skipped["layers/*/attn/v_proj"] = why
        else:
            _rotate_heads(c, new, rotation.seed)
            rotated.append("heads")
    if untied:
        config = dataclasses.replace(config, tie_embeddings=False)
    return config, new, RotationReport(tuple(rotated), tuple(folded), skipped, untied)


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    return tree


def _rotate_residual(c: DecoderConfig, p: dict, q: np.ndarray, folded: list[str]) -> bool:
    """Folds every norm and rotates the stream in place in `p`; True if the head was untied."""
    emb = p["embed"]["embedding"]
    p["embed"]["embedding"] = _rotate_out(emb, q)
    for i, layer in p["layers"].items():
        attn, s = layer["attn"], np.asarray(layer["attn_norm"]["scale"], np.float64)
        for name in ("qkv_proj",) if c.fused_qkv else ("q_proj", "k_proj", "v_proj"):
            attn[name] = dict(attn[name], kernel=_fold_in(attn[name]["kernel"], s, q))
        attn["o_proj"] = dict(attn["o_proj"], kernel=_rotate_out(attn["o_proj"]["kernel"], q))
        layer["attn_norm"] = {"scale": _cast(np.ones_like(s), layer["attn_norm"]["scale"])}
        folded.append(f"layers/{i}/attn_norm/scale")
        s = np.asarray(layer["mlp_norm"]["scale"], np.float64)
        if "moe" in layer:
            moe = layer["moe"]
            moe["router"] = _fold_in(moe["router"], s, q)
            for name in ("gate_proj", "up_proj"):
                moe[name] = dict(moe[name], kernel=_fold_in(moe[name]["kernel"], s, q))
            moe["down_proj"] = dict(
                moe["down_proj"], kernel=_rotate_out(moe["down_proj"]["kernel"], q)
            )
            if "shared" in moe:
                moe["shared_gate"] = _fold_in(moe["shared_gate"], s, q)
                _fold_mlp(moe["shared"], s, q)
        else:
            _fold_mlp(layer["mlp"], s, q)
        layer["mlp_norm"] = {"scale": _cast(np.ones_like(s), layer["mlp_norm"]["scale"])}
        folded.append(f"layers/{i}/mlp_norm/scale")
        # Post-norms reach here only with a uniform scale, which commutes with Q.
    s = np.asarray(p["norm"]["scale"], np.float64)
    head = p["lm_head"]["kernel"] if "lm_head" in p else np.asarray(emb).T
    p["lm_head"] = {"kernel": _fold_in(head, s, q)}
    p["norm"] = {"scale": _cast(np.ones_like(s), p["norm"]["scale"])}
    folded.append("norm/scale")
    return c.tie_embeddings


def _fold_mlp(mlp: dict, s: np.ndarray, q: np.ndarray) -> None:
    for name in ("gate_up_proj",) if "gate_up_proj" in mlp else ("gate_proj", "up_proj"):
        mlp[name] = dict(mlp[name], kernel=_fold_in(mlp[name]["kernel"], s, q))
    mlp["down_proj"] = dict(mlp["down_proj"], kernel=_rotate_out(mlp["down_proj"]["kernel"], q))


def _rotate_heads(c: DecoderConfig, p: dict, seed: int) -> None:
    """v_proj's outputs per key/value head times ``R``, o_proj's inputs per query head times
    ``Rᵀ`` (rows ``h·D .. (h+1)·D`` of o_proj's kernel become ``Rᵀ W_o[h]``)."""
    # R = H diag(±1): an int4 KV cache rotates stored values by H again (online), and for a
    # power of two H H = I would undo a plain H; H D H is a dense rotation.
    signs = np.random.default_rng(seed + 1).choice(np.array([-1.0, 1.0]), size=c.head_dim)
    r = hadamard_matrix(c.head_dim, np.float64) * signs[None, :]
    d, kv_dim, q_dim = c.head_dim, c.n_kv_heads * c.head_dim, c.n_heads * c.head_dim

    def per_head(x: Any) -> np.ndarray:  # [..., kv_dim] -> the same, each head times R
        x64 = np.asarray(x, np.float64)
        heads = x64.reshape(*x64.shape[:-1], c.n_kv_heads, d) @ r
        return _cast(heads.reshape(x64.shape), x)

    for layer in p["layers"].values():
        attn = layer["attn"]
        if c.fused_qkv:
            proj = dict(attn["qkv_proj"])
            for key in [k for k in ("kernel", "bias") if k in proj]:
                x = np.asarray(proj[key])
                v = per_head(x[..., q_dim + kv_dim :])
                proj[key] = np.concatenate([x[..., : q_dim + kv_dim], v], axis=-1)
            attn["qkv_proj"] = proj
        else:
            attn["v_proj"] = {k: per_head(v) for k, v in attn["v_proj"].items()}
        w = np.asarray(attn["o_proj"]["kernel"], np.float64).reshape(c.n_heads, d, c.dim)
        w = np.einsum("ij,hjo->hio", r.T, w).reshape(q_dim, c.dim)
        attn["o_proj"] = dict(attn["o_proj"], kernel=_cast(w, attn["o_proj"]["kernel"]))


def decoder_from_params(config: DecoderConfig, params: dict, *, dtype: Any = None) -> Decoder:
    """A `Decoder` of `config` holding `params` (a pure dict), e.g. `rotate_decoder`'s."""
    kw = {} if dtype is None else dict(dtype=dtype)
    graphdef, state = nnx.split(Decoder.abstract(config, **kw))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def rotate_model(
    model: Decoder, rotation: RotationConfig | None = None
) -> tuple[Decoder, RotationReport]:
    """`rotate_decoder` on a `Decoder` module: a new module (the input is not modified)."""
    params = nnx.to_pure_dict(nnx.split(model)[1])
    config, params, report = rotate_decoder(model.config, params, rotation)
    return decoder_from_params(config, params, dtype=model.dtype), report
