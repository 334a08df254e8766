"""`Grammars` and `Constraint` on the tiny model's byte-level tokenizer (one token per byte,
258 the stop token): masks are bits as wide as the logits, advanced token by token."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.server._grammar import MAX_SCHEMA_BYTES, GrammarError, Grammars

STOP = 258


@pytest.fixture(scope="module")
def grammars(loaded):
    # Logits wider than the vocabulary: the extra ids must never be allowed.
    return Grammars(loaded.tokenizer, [STOP], loaded.tokenizer.get_vocab_size() + 12)


def _allowed(constraint):
    return set(np.flatnonzero(constraint.allowed).tolist())


def test_a_mask_allows_what_the_grammar_allows_and_nothing_past_the_vocabulary(grammars):
    c = grammars.constrain({"enum": ["yes", "no"]})
    assert c.bits.shape == (-(-grammars.width // 32),) and c.bits.dtype == np.uint32
    assert c.allowed.shape == (grammars.width,)
    assert _allowed(c) == {ord('"')}
    assert c.advance(ord('"'))
    assert _allowed(c) == {ord("y"), ord("n")}
    for byte in b"no":
        assert c.advance(byte)
    assert not c.advance(ord('"'))  # complete: nothing may follow, the row ends


def test_the_stop_token_is_allowed_where_the_grammar_may_end(grammars):
    c = grammars.constrain({"type": "integer"})
    assert STOP not in _allowed(c)
    assert c.advance(ord("4")) and c.advance(ord("2"))
    allowed = _allowed(c)
    assert STOP in allowed and ord("7") in allowed and ord("x") not in allowed


def test_each_constraint_is_fresh(grammars):
    a = grammars.constrain({"type": "object"})
    assert a.advance(ord("{"))
    b = grammars.constrain({"type": "object"})
    assert _allowed(b) == {ord("{")} and _allowed(a) != {ord("{")}


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "pattern": "(("}, "regex"),
        ({"$ref": "#/nowhere"}, "nowhere"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
        ({"enum": ["x" * (MAX_SCHEMA_BYTES + 1)]}, "at most"),
    ],
)
def test_a_schema_that_cannot_be_compiled_says_why(grammars, schema, why):
    with pytest.raises(GrammarError, match=why):
        grammars.constrain(schema)


def test_the_device_unpacks_the_bits_the_host_set(grammars):
    # What the sampler allows (`unpack_allowed`, on the device) is what the grammar allows;
    # a row without a grammar (`allowed_bits` of the whole width) allows every id.
    from lowbit.server._programs import allowed_bits, unpack_allowed

    c = grammars.constrain({"enum": ["yes", "no"]})
    assert c.advance(ord('"'))
    words = np.stack([c.bits, allowed_bits(len(c.bits), grammars.width)])
    got = np.asarray(unpack_allowed(jnp.asarray(words), grammars.width))
    assert set(np.flatnonzero(got[0]).tolist()) == {ord("y"), ord("n")}
    assert got[1].all()
