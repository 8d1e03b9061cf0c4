"""Constrained decoding: a reply held to a JSON schema, a regular expression or a grammar, token by token.

llguidance (what llama.cpp and vLLM use) computes which tokens may come next; the sampler sees every other
logit at -inf. It was chosen over xgrammar for two reasons, measured in bench/constrained.py: xgrammar's wheel
requires torch, transformers and triton (the run side must not import torch), and llguidance's mask costs a few
microseconds per token on a 49k and a 262k vocabulary alike (its lexer works on token-trie slices, not the
whole vocabulary).

A Grammar is compiled once per request (a bad schema is refused before the engine is touched); a Constraint
follows one reply. Nothing here runs for a turn without one: the sampler is then exactly as before.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EddyError


class GrammarError(EddyError):
    """A schema, regular expression or grammar that cannot be compiled, or a reply the grammar cannot follow."""


# JSON as a model writes it naturally (`{"a": 1, "b": 2}`): with llguidance's flexible whitespace a sampled
# reply may wander into pages of blank lines, which no client wants.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def styled(schema: dict) -> dict:
    """`schema` with Eddy's JSON layout, unless the schema sets its own."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_STYLE}


@dataclass(frozen=True)
class Grammar:
    """A compiled-to-text llguidance grammar and what it was made from (for messages)."""
    text: str
    what: str

    @staticmethod
    def json_schema(schema: Any) -> "Grammar":
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        return _made(_llg().LLMatcher.grammar_from_json_schema, json.dumps(styled(schema)), "JSON schema")

    @staticmethod
    def json_object() -> "Grammar":
        return Grammar.json_schema({"type": "object"})

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        return _made(_llg().LLMatcher.grammar_from_regex, pattern, "regular expression")

    @staticmethod
    def lark(text: str) -> "Grammar":
        """A Lark grammar (llguidance's dialect: `%json {...}` embeds a schema, `<[id]>` a token)."""
        return _made(_llg().LLMatcher.grammar_from_lark, text, "grammar")

    @staticmethod
    def gbnf(text: str) -> "Grammar":
        """A llama.cpp GBNF grammar, as llama-server's `grammar` field takes it."""
        try:
            return Grammar.lark(_llg().gbnf_to_lark.any_to_lark(text))
        except GrammarError:
            raise
        except Exception as e:  # the converter raises whatever its parser met
            raise GrammarError(f"the grammar could not be read: {e}") from None


class Grammars:
    """One tokenizer's view for llguidance (built once, about 0.2 s for 49k tokens) and the grammars checked
    against it."""

    def __init__(self, tokenizer_json: str, stop_ids: frozenset[int], vocab_size: int) -> None:
        self._json, self._stops, self.vocab_size = tokenizer_json, sorted(stop_ids), vocab_size
        self._tok: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._tok is None:
                self._tok = _llg().LLTokenizer(self._json, n_vocab=self.vocab_size, eos_token=self._stops)
            return self._tok

    def check(self, grammar: Grammar) -> None:
        """GrammarError with llguidance's own words if the grammar cannot be used (run before the engine is)."""
        ok, error = _validate(grammar.text, self._tokenizer())
        if not ok:
            raise GrammarError(f"the {grammar.what} cannot be used: {error}")

    def follow(self, grammar: Grammar) -> "Constraint":
        matcher = _llg().LLMatcher(self._tokenizer(), grammar.text)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.what} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One reply's place in its grammar: compute() before each sample, allows() or mask(), then accept().

    The sampler first draws from the logits as they are and keeps the token when the grammar allows it (one bit
    to test); only a token the grammar forbids costs the masked logits and a second draw, as llama.cpp does it.
    Greedy decoding picks what the masked argmax would; a sampled token is one drawn from the allowed tokens in
    proportion to their probability, as a draw from the masked distribution is (the two differ only in
    where top-k and top-p cut)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def compute(self) -> None:
        """The allowed next tokens, into the bitmask (a few microseconds: llguidance slices its token trie)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def allows(self, token: int) -> bool:
        return 0 <= token < self._vocab and bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf (after compute(); the model's
        vocabulary may be padded past the tokenizer's: those never pass)."""
        n = min(self._vocab, logits.size)
        allowed = np.zeros(logits.size, dtype=bool)
        allowed[:n] = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=n).view(bool)
        if not allowed.any():
            raise GrammarError(f"the grammar allows no next token: {self._matcher.get_error() or 'a dead end'}")
        return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the reply left its grammar: {self._matcher.get_error()}")


def _validate(text: str, tokenizer: Any) -> tuple[bool, str]:
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    return not failed, "; ".join(messages)


def _made(build: Any, source: str, what: str) -> Grammar:
    try:
        return Grammar(build(source), what)
    except Exception as e:  # the library raises ValueError or its own errors for text it cannot read
        raise GrammarError(f"the {what} could not be read: {e}") from None


def _llg() -> Any:
    # Imported when a request first asks for a constraint: a chat without one never loads the library.
    import llguidance
    import llguidance.gbnf_to_lark  # noqa: F401  (Grammar.gbnf)

    return llguidance
