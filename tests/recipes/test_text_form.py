"""The text-form prelude and the field-named errors that the recipe parsers share."""

import pytest

from lowbit.recipes import KVCacheConfig, RotationConfig, parse_kv_cache, parse_rotation
from lowbit.recipes._text_form import field_errors, split_text_form


def test_split_text_form_strips_lowers_and_splits_the_flag():
    assert split_text_form(" Int8+QK ", KVCacheConfig, "f", "x", "forms", "+qk") == ("int8", True)
    assert split_text_form("int4:g32", KVCacheConfig, "f", "x", "forms", "+qk") == (
        "int4:g32",
        False,
    )


@pytest.mark.parametrize("value", [None, "", " none ", "FLOAT"])
def test_split_text_form_off_words_are_none(value):
    assert split_text_form(value, KVCacheConfig, "f", "x", "forms", "+qk") is None


def test_split_text_form_passes_a_config_through():
    config = KVCacheConfig(format="int8")
    assert split_text_form(config, KVCacheConfig, "f", "x", "forms", "+qk") is config
    assert parse_kv_cache(config) is config
    rotation = RotationConfig(strict=True)
    assert parse_rotation(rotation) is rotation


def test_split_text_form_refuses_a_non_string_naming_field_and_forms():
    with pytest.raises(ValueError, match=r"^kv: 8 is not a KV cache format; accepted: a \| b$"):
        split_text_form(8, KVCacheConfig, "kv", "a KV cache format", "a | b", "+qk")
    with pytest.raises(ValueError, match=r"^Recipe.rotate: \['h'\] is not a rotation"):
        parse_rotation(["h"], "Recipe.rotate")


def test_field_errors_prefixes_the_field_and_drops_the_chain():
    with pytest.raises(ValueError, match=r"^Rule.weight: bad size$") as info:
        with field_errors("Rule.weight"):
            raise ValueError("bad size")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_field_errors_lets_other_errors_through():
    with pytest.raises(TypeError, match="^not mine$"):
        with field_errors("f"):
            raise TypeError("not mine")


def test_kv_cache_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^--kv-cache: kv_cache int4 group_size=3 must be even"):
        parse_kv_cache("int4:g3", "--kv-cache")
