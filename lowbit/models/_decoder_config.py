"""`DecoderConfig`: the choices that tell one decoder-only architecture from another (see
`lowbit.models._decoder`), with their checks.
"""

from __future__ import annotations

import dataclasses
import math

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Hyper-parameters of a decoder; the defaults are SmolLM2-135M's (Llama architecture).

    Attributes:
      architecture: the family it was read as (``"llama"``, ``"qwen3"``, ``"gemma2"`` ...),
        for messages and export; the fields below decide the computation.
      vocab_size, dim, n_layers, ffn_dim, n_heads, n_kv_heads, head_dim: shapes. ``head_dim``
        need not be ``dim / n_heads`` (Gemma).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the embedding also produces the logits.
      qkv_bias: q/k/v projections have biases (Qwen2).
      rope_base: RoPE base of global layers (and of all layers without `rope_base_local`).
      context_length: the longest context the model was trained for.
      qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
      post_norms: RMSNorm on each sub-block's output before the residual add (Gemma 2/3).
      activation: the gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
      embed_scale: multiply embeddings by ``sqrt(dim)`` (Gemma).
      query_scale: the factor on ``q · k``; None for ``head_dim ** -0.5``.
      attn_softcap, final_softcap: ``c * tanh(x / c)`` on attention scores / logits (Gemma 2).
      sliding_window: local layers attend to the last this many positions (their own
        included); None for none.
      global_every: with a window, every `global_every`-th layer (1-based) attends globally
        (Gemma 2: 2, Gemma 3: 6); 0 puts the window on every layer (Mistral).
      rope_base_local: RoPE base of local layers (Gemma 3); None for `rope_base`.
      rope_scale: linear RoPE scaling (positions divided by it) on layers using `rope_base`.
      rope_freq_factors: per-frequency divisors (``head_dim / 2`` of them): Llama 3's scaling.
      n_experts, n_experts_used, expert_ffn_dim: a mixture of experts in place of the MLP when
        `n_experts` > 0: each token goes to its `n_experts_used` best experts.
      norm_topk: renormalize the chosen experts' router probabilities to sum to 1.
      shared_ffn_dim: a shared expert MLP every token uses, gated by ``sigmoid(x · w)``
        (Qwen2-MoE); 0 for none.
      fused_qkv: one ``qkv_proj`` whose outputs are q, k then v (Phi-3), in place of three.
      fused_gate_up: one ``gate_up_proj`` whose outputs are gate then up (Phi-3).
    """

    # The family, the residual stream, then attention and its positions.
    architecture: str = "llama"
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    ffn_dim: int = 1536
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    qkv_bias: bool = False
    rope_base: float = 100000.0
    context_length: int = 8192
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    global_every: int = 0
    rope_base_local: float | None = None
    rope_scale: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = None
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = True
    shared_ffn_dim: int = 0
    fused_qkv: bool = False
    fused_gate_up: bool = False

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "context_length")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"DecoderConfig.{name} is {getattr(self, name)!r}; it must be a "
                    "positive integer"
                )
        if self.n_layers < 0 or (self.ffn_dim < 1 and self.n_experts == 0):
            raise ValueError(
                f"DecoderConfig: n_layers={self.n_layers}, ffn_dim={self.ffn_dim} "
                "must be non-negative / positive"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"DecoderConfig.n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"DecoderConfig.head_dim={self.head_dim} must be even for rotary embeddings"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.activation is {self.activation!r}; accepted: {ACTIVATIONS}"
            )
        for name in ("rope_base", "norm_eps", "rope_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DecoderConfig.{name} is {value!r}; it must be finite and > 0")
        for name in ("query_scale", "attn_softcap", "final_softcap", "rope_base_local"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"DecoderConfig.{name} is {value!r}; give a positive number or None"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"DecoderConfig.sliding_window is {self.sliding_window}; give a positive "
                "number of positions or None"
            )
        if self.global_every < 0:
            raise ValueError(f"DecoderConfig.global_every is {self.global_every}; it must be >= 0")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"DecoderConfig.rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                f"head_dim={self.head_dim} needs {self.head_dim // 2}"
            )
        if self.n_experts:
            if not 1 <= self.n_experts_used <= self.n_experts or self.expert_ffn_dim < 1:
                raise ValueError(
                    f"DecoderConfig: n_experts={self.n_experts} needs 1 <= n_experts_used "
                    f"(={self.n_experts_used}) <= n_experts and expert_ffn_dim "
                    f"(={self.expert_ffn_dim}) >= 1"
                )
        elif self.n_experts_used or self.shared_ffn_dim:
            raise ValueError("DecoderConfig: n_experts_used / shared_ffn_dim need n_experts > 0")

    @property
    def attn_scale(self) -> float:
        """The factor on ``q · k``."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def is_local(self, layer: int) -> bool:
        """Whether `layer` (0-based) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.global_every == 0 or (layer + 1) % self.global_every != 0
