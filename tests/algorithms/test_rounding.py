"""One rounding object per algorithm config: the table, `needs_data`, `round`, bad input."""

import jax
import pytest

from lowbit.algorithms import (
    AlgorithmReport,
    Context,
    HqqRounding,
    check_algorithm,
    rounding_for,
)
from lowbit.qarray import MinMax, PerGroup, QArray, QuantConfig
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import ALGORITHMS, AWQ, GPTQ, HQQ, Rule, SmoothQuant

INT4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
UINT4 = QuantConfig(
    format="uint4", granularity=PerGroup(8, axis=0), symmetric=False, calibration=MinMax()
)


@pytest.mark.parametrize("algorithm", [GPTQ(), AWQ(), SmoothQuant(), HQQ()], ids=str)
def test_every_algorithm_config_has_a_rounding_that_says_whether_it_needs_data(algorithm):
    rounding = rounding_for(algorithm)
    assert rounding.needs_data == algorithm.needs_data
    assert callable(rounding.round)


def test_the_table_covers_every_algorithm_recipes_define():
    for algorithm in ALGORITHMS.values():
        assert rounding_for(algorithm()).algorithm == algorithm()


def test_hqq_rounds_without_statistics_and_reports():
    w = jax.random.normal(jax.random.key(0), (16, 4))
    ctx = Context(statistics=None, report=AlgorithmReport())
    nearest = lambda x: quantize_array(x, UINT4)
    q = HqqRounding(HQQ()).round("w", w, UINT4, nearest, ctx)
    assert isinstance(q, QArray) and ctx.report.applied["w"].startswith("hqq")


def test_check_algorithm_names_the_rule_the_format_and_the_fix():
    with pytest.raises(ValueError, match=r"rule 2 \(path='.\*'\).*'hqq'.*symmetric.*uintN"):
        check_algorithm(2, Rule(weight=INT4, algorithm=HQQ()), INT4)
    with pytest.raises(ValueError, match=r"rule 0 .*'smoothquant'.*activation config"):
        check_algorithm(0, Rule(weight=INT4, algorithm=SmoothQuant()), INT4)
    check_algorithm(0, Rule(weight=UINT4, algorithm=HQQ()), UINT4)  # accepted
