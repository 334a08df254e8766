"""Registry-driven contract: every format gets the same checks."""

import jax.numpy as jnp
import numpy as np
import pytest
from formats_support import jit, round_trip_for

import lowbit.formats as formats
from lowbit.formats import ALIASES, FORMATS, Format, GGUFBlockFormat, format_names, get_format

ALL = sorted(FORMATS)
# Element formats: a code table and a grid (GGUF block formats store whole blocks instead).
ELEMENT = sorted(n for n, f in FORMATS.items() if not isinstance(f, GGUFBlockFormat))
EXPECTED = (
    [f"int{n}" for n in range(1, 9)]
    + [f"uint{n}" for n in range(1, 9)]
    + ["fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6_e2m3", "fp6_e3m2"]
    + ["fp4_e2m1", "nf4", "ternary", "ternary_b3"]
    + ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8", "nvfp4"]
    + ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "q5_0", "q5_1", "iq4_nl", "iq4_xs"]
    + ["tq1_0", "tq2_0"]
)


def test_registry_holds_every_format_once():
    assert sorted(EXPECTED) == ALL == list(format_names())
    for name, fmt in FORMATS.items():
        assert fmt.name == name and fmt.overflow == "saturate"
    for alias, name in ALIASES.items():
        assert get_format(alias) is FORMATS[name]


def test_public_names_are_exported():
    for name in formats.__all__:
        assert hasattr(formats, name), name


def test_unknown_name_lists_accepted_names():
    with pytest.raises(ValueError, match="unknown format 'int9'") as info:
        get_format("int9")
    message = str(info.value)
    for name in ALL + list(ALIASES):
        assert name in message
    with pytest.raises(TypeError, match=r"format name \(str\) or a Format"):
        get_format(4)
    assert get_format(FORMATS["int4"]) is FORMATS["int4"]


@pytest.mark.parametrize("name", ELEMENT)
def test_every_code_round_trips_and_grid_bounds(name):
    """encode(decode(c)) == c for every valid code; decode gives float32 grid values; the
    grid's ends are max_value / min_value and values past them saturate."""
    fmt = get_format(name)
    codes = fmt.codes()
    far = np.array([1e30, -1e30, np.inf, -np.inf], np.float32)
    values, back, ends = round_trip_for(name)(codes, far)
    assert values.dtype == jnp.float32
    assert np.isfinite(np.asarray(values)).all()
    assert back.dtype == fmt.code_dtype
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), codes.view(np.uint8))

    assert isinstance(fmt, Format)
    levels = fmt.levels()
    assert np.all(np.diff(levels) > 0)
    assert levels[-1] == fmt.max_value
    assert levels[0] == fmt.min_value
    assert fmt.signed == (fmt.min_value < 0)
    assert len(levels) <= 2**fmt.bits
    assert 0 < fmt.bits_per_value <= fmt.bits
    assert np.dtype(fmt.code_dtype).itemsize == 1
    np.testing.assert_array_equal(ends, [levels[-1], levels[0], levels[-1], levels[0]])


def test_levels_are_usable_while_tracing():
    # Stochastic rounding reads levels inside jit: they must be concrete NumPy values.
    fmt = get_format("fp4_e2m1")
    out = jit(lambda x: x + jnp.asarray(fmt.levels(), jnp.float32))(jnp.zeros(15))
    np.testing.assert_array_equal(np.asarray(out), fmt.levels())
