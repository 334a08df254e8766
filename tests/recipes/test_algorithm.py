"""Algorithm settings: each field checked on construction against its class's table."""

import pytest

from lowbit.recipes import AWQ, GPTQ, HQQ, SmoothQuant


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (GPTQ, {"damp": 0}, "GPTQ.damp: 0; accepted: 0 < damp < 10"),
        (GPTQ, {"refine": True}, "GPTQ.refine: True; accepted: an int >= 0"),
        (GPTQ, {"act_order": 1}, "GPTQ.act_order: 1; accepted: true or false"),
        (AWQ, {"grid": 0}, "AWQ.grid: 0; accepted: an int > 0"),
        (
            SmoothQuant,
            {"grid": -1},
            r"SmoothQuant.grid: -1; accepted: an int >= 0 \(0: no search\)",
        ),
        (HQQ, {"kappa": 1.0}, "HQQ.kappa: 1.0; accepted: a number > 1"),
    ],
)
def test_a_bad_field_names_the_class_the_field_and_what_is_accepted(cls, kwargs, message):
    with pytest.raises(ValueError, match="^" + message + "$"):
        cls(**kwargs)


def test_the_first_failing_check_in_table_order_is_reported():
    with pytest.raises(ValueError, match=r"^GPTQ\.damp"):
        GPTQ(damp=-1, block=0)


@pytest.mark.parametrize("cls", [GPTQ, AWQ, SmoothQuant, HQQ])
def test_every_field_is_checked(cls):
    assert set(cls.checks) == {f for f in cls.__dataclass_fields__}
    assert cls() == cls() and hash(cls()) == hash(cls())
