"""Calibrators: field checks and the masked statistics their bounds are built from."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.formats import get_format
from lowbit.qarray import AbsMax, AbsMean
from lowbit.qarray._calibration import RMS


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda v: AbsMax(clip=v), "AbsMax.clip"),
        (lambda v: AbsMean(multiplier=v), "AbsMean.multiplier"),
        (lambda v: RMS(multiplier=v), "RMS.multiplier"),
    ],
)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), True, "1"])
def test_positive_fields_refuse_a_non_positive_or_non_number(make, name, bad):
    with pytest.raises(ValueError, match=rf"^{name}=.*accepted: a positive finite number"):
        make(bad)


def test_mean_statistics_skip_non_finite_elements():
    blocks = jnp.asarray([[1.0, -3.0, jnp.nan, jnp.inf], [jnp.nan, jnp.nan, jnp.nan, jnp.nan]])
    fmt = get_format("int8")
    _, hi = AbsMean().bounds(blocks, fmt=fmt, symmetric=True)
    np.testing.assert_allclose(hi, [2.0 * fmt.max_value, 0.0])
    _, hi = RMS(multiplier=1.0).bounds(blocks, fmt=fmt, symmetric=True)
    np.testing.assert_allclose(hi, [np.sqrt(5.0), 0.0], rtol=1e-6)
