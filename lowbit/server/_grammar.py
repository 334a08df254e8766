"""Grammar-constrained decoding: JSON schemas compiled (by llguidance) into a per-request
`Constraint` whose allowed-token mask biases the next sampled token.

A `Grammars` is built once per server from the served tokenizer. `Grammars.constrain`
compiles a schema into a matcher, bounded in work (`LIMITS`, `MAX_SCHEMA_BYTES`), and returns
a `Constraint` holding the mask of the first token. The scheduler then calls
`Constraint.advance` with each emitted token, which computes the next mask on the host.

Masks are bits, one per id of the model's logits width ``V`` (which may exceed the
tokenizer's vocabulary: those extra ids are never allowed): llguidance's own bitmask, bit
``t % 32`` of word ``t // 32`` set where the grammar allows token ``t``. The scheduler uploads
these ``V / 32`` words a step (not ``V`` floats) and the sampler unpacks them on the device
(`lowbit.server._programs.RowSampling`).
Where the grammar may end, it allows the served stop tokens, so a row ends as any other; where
it must end, `advance` says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance
import numpy as np

from lowbit.server._programs import allowed_bits, unpack_allowed

# The largest schema compiled, as compact JSON.
MAX_SCHEMA_BYTES = 32 * 1024
# The largest Lark grammar compiled (tool calls: up to 128 tools' schemas and their framing).
MAX_LARK_BYTES = 1024 * 1024
# Bounds on llguidance's work per schema and per token (its defaults are in brackets): the
# compile's lexer fuel (1M, ~20 ms), grammar symbols (500K), lexer states (250K, ~1-2 kB each,
# built lazily while decoding), Earley items per token (50K) and a token's lexer fuel (200K).
LIMITS = dict(
    initial_lexer_fuel=1_000_000,
    max_grammar_size=100_000,
    max_lexer_states=20_000,
    step_max_items=50_000,
    step_lexer_fuel=200_000,
    verbose_errors=False,  # error messages quote the schema's rule, not the parser's state
)
# Compact JSON with the usual spaces after separators: no free whitespace, so a model cannot
# spin on newlines forever inside a valid answer.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A schema that cannot be compiled (the message says why)."""


class Constraint:
    """One request's grammar state (used by one thread at a time).

    Attributes:
      bits: ``[ceil(V / 32)]`` uint32, the tokens the next one may be: bit ``t % 32`` of
        word ``t // 32`` set where token ``t`` is allowed.
    """

    def __init__(self, matcher: Any, vocab: int, width: int):
        self._matcher = matcher
        self._width = width
        self._words = np.zeros((-(-vocab // 32),), np.uint32)  # llguidance's bitmask
        self.bits = np.zeros((-(-width // 32),), np.uint32)
        # Ids below both the vocabulary and the logits width: the only ones ever allowed.
        self._keep = allowed_bits(-(-width // 32), min(vocab, width))[: len(self._words)]
        if not self._refresh():
            raise GrammarError(matcher.get_error() or "the grammar allows no first token")

    def _refresh(self) -> bool:
        """Computes `bits` for the matcher's state; False when it allows nothing."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            return False
        np.bitwise_and(self._words[: len(self._keep)], self._keep, out=self.bits[: len(self._keep)])
        return bool(self.bits.any())

    @property
    def allowed(self) -> np.ndarray:
        """``[V]`` bool, `bits` unpacked: True where the next token may be that id."""
        return np.asarray(unpack_allowed(self.bits[None], self._width))[0]

    def advance(self, token: int) -> bool:
        """Feeds `token` (never a stop token); False when the row must end: the grammar is
        complete and takes no more, or the token broke it or a work bound (`LIMITS`)."""
        m = self._matcher
        try:
            if not m.consume_token(int(token)) or m.is_stopped():
                return False
            return self._refresh()
        except Exception:  # noqa: BLE001 - one request's grammar never takes the scheduler down
            return False


class Grammars:
    """Compiles response formats for one served tokenizer.

    Args:
      tokenizer: the served `tokenizers.Tokenizer`.
      stop_ids: the token ids that end an answer (allowed where the grammar may end).
      width: the model's logits width ``V`` (at least the tokenizer's vocabulary, or less,
        then the ids past it are never allowed).
    """

    def __init__(self, tokenizer: Any, stop_ids: Iterable[int], width: int):
        self.vocab = tokenizer.get_vocab_size()
        self.width = width
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=self.vocab, eos_token=sorted(stop_ids)
        )
        self._limits = llguidance.LLParserLimits(**LIMITS)

    def constrain(self, schema: dict[str, Any]) -> Constraint:
        """A fresh `Constraint` for JSON matching `schema` (`ANY_OBJECT` for any object).
        Runs in tens of milliseconds, at most about a second (`LIMITS`); it releases the GIL.

        Raises:
          GrammarError: the schema is too large, not one llguidance can compile, or admits no
            answer.
        """
        text = json.dumps(schema, separators=(",", ":"))
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(
                f"is {len(text.encode())} bytes as compact JSON; at most {MAX_SCHEMA_BYTES} "
                "are accepted"
            )
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
        except ValueError as err:
            raise GrammarError(str(err)) from None
        return self._matched(grammar)

    def constrain_lark(self, lark: str) -> Constraint:
        """A fresh `Constraint` for text matching the Lark grammar `lark` (llguidance's
        dialect, which embeds JSON schemas with ``%json``); bounded as `constrain`.

        Raises:
          GrammarError: the grammar is too large or cannot be compiled.
        """
        if len(lark.encode()) > MAX_LARK_BYTES:
            raise GrammarError(f"is {len(lark.encode())} bytes; at most {MAX_LARK_BYTES}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except ValueError as err:
            raise GrammarError(str(err)) from None
        return self._matched(grammar)

    def _matched(self, grammar: str) -> Constraint:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.vocab, self.width)
