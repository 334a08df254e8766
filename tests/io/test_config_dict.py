"""QuantConfig <-> dict, as stored in checkpoint manifests."""

import json

import jax.numpy as jnp
import pytest

from lowbit.io import quant_config_from_dict, quant_config_to_dict
from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    AbsMean,
    Fixed,
    MinMax,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    PerToken,
    QuantConfig,
)

CONFIGS = [
    QuantConfig(),
    QuantConfig(
        format="uint4",
        granularity=PerGroup(32, axis=1),
        calibration=MinMax(),
        symmetric=False,
        scale_dtype=jnp.bfloat16,
        pack=False,
    ),
    QuantConfig(format="int8", granularity=PerToken(), calibration=Fixed(-6.0, 6.0)),
    QuantConfig(
        format="fp8_e4m3fn", granularity=PerChannel(axes=(0, 2)), calibration=Percentile(99.5)
    ),
    QuantConfig(format="int4", granularity=PerBlock((128, 64)), calibration=MSE(grid=(1.0, 0.9))),
    QuantConfig(calibration=AbsMean(0.7), rounding="stochastic", scale_dtype=jnp.float16),
    QuantConfig(calibration=RMS(4.0)),
    QuantConfig(format="nvfp4", calibration=AbsMax(0.9)),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_round_trip_through_json(config):
    text = json.dumps(quant_config_to_dict(config))
    assert quant_config_from_dict(json.loads(text)) == config


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(format="int42"), "format: 'int42' is not a format"),
        (lambda d: d.update(granularity="per_row"), "'per_row' is not a granularity"),
        (lambda d: d.update(scale_dtype="float64"), "scale_dtype: 'float64'"),
        (lambda d: d.pop("pack"), "has keys"),
        (lambda d: d.update(code="print(1)"), "has keys"),
    ],
)
def test_bad_dicts_are_refused(edit, match):
    data = quant_config_to_dict(QuantConfig())
    edit(data)
    with pytest.raises(ValueError, match=match):
        quant_config_from_dict(data)
