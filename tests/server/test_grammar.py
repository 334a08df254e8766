"""`Grammars` and `Constraint` on the tiny model's byte-level tokenizer (one token per byte,
258 the stop token): masks are 0 / -inf rows as wide as the logits, advanced token by token."""

import numpy as np
import pytest

from lowbit.server._grammar import MAX_SCHEMA_BYTES, GrammarError, Grammars

STOP = 258


@pytest.fixture(scope="module")
def grammars(loaded):
    # Logits wider than the vocabulary: the extra ids must never be allowed.
    return Grammars(loaded.tokenizer, [STOP], loaded.tokenizer.get_vocab_size() + 12)


def _allowed(constraint):
    assert set(np.unique(constraint.mask)) <= {0.0, -np.inf}
    return set(np.flatnonzero(constraint.mask == 0).tolist())


def test_a_mask_allows_what_the_grammar_allows_and_nothing_past_the_vocabulary(grammars):
    c = grammars.constrain({"enum": ["yes", "no"]})
    assert c.mask.shape == (grammars.width,) and c.mask.dtype == np.float32
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
