"""`lowbit.quantize_params` with its algorithm report, as the algorithm tests call it."""

import lowbit
from lowbit.algorithms import AlgorithmReport
from lowbit.api import AlgorithmOptions


def quantize_with_report(
    params, recipe, *, row_mask=None, statistics=None, sequential=1, **options
):
    """(quantized params, `AlgorithmReport`) of `lowbit.quantize_params`."""
    report = AlgorithmReport()
    algorithm_options = AlgorithmOptions(
        row_mask=row_mask, statistics=statistics, sequential=sequential
    )
    q = lowbit.quantize_params(
        params, recipe, algorithm_options=algorithm_options, report=report, **options
    )
    return q, report
