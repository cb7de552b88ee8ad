"""Guided decoding (structured outputs): a grammar masks the tokens the sampler may draw, so the
output stays a prefix of the grammar's language and, once the grammar is complete, only EOS is
left. The engine is llguidance (`scripts/bench_grammar_mask.py` measured it and xgrammar here).

A grammar is compiled once per request (`GrammarCompiler.compile`, at the RPC, so a bad schema is
an INVALID_ARGUMENT before anything runs); each generating sequence (each of n parallel samples)
walks it with a `GrammarMatcher` of its own. Masks are per position: the speculative verifier
(common/engine/speculative.py) draws draft position i through the matcher after accepting drafts [0, i),
and a rejected draft token never reaches it, so drafted and sampled tokens obey the same grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

import llguidance
import numpy as np
import torch

from common.engine.json_grammar import json_schema_grammar, unpanicked
from common.model.tokenizer import Tokenizer

MAX_GRAMMAR_CHARS = 100_000


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match (duet.v1 GuidedDecoding): `kind` json_schema (`value`
    the schema's JSON text), json_object (True), regex (the pattern) or choice (the strings)."""

    kind: str
    value: str | bool | tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Grammar:
    """A validated grammar, in llguidance's serialized form, for one tokenizer."""

    source: str
    tokenizer: llguidance.LLTokenizer
    spec: GuidedSpec  # what it was compiled from: a migration hands it on

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GrammarDeadEnd(RuntimeError):
    """The grammar and this model's tokens cannot go on: nothing may come next, or llguidance's
    mask let through a token its parser then refused (a regex byte the vocabulary cannot spell
    where llguidance expects it). A fault of the request's grammar for this model, not of the node."""


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.source)
        # One bit per token. llguidance.torch would fill a tensor the same way, but importing it
        # runs torch.compile, which costs a daemon over a second at start.
        self._bits = np.zeros((grammar.tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """`[vocab_size]` bool: the tokens that may come next. Raises RuntimeError when the
        grammar has failed (nothing may come next): GrammarDeadEnd."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, bits.size)
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        if not bool(allowed.any()):
            raise GrammarDeadEnd(f"the grammar allows no next token: {self._matcher.get_error() or 'dead end'}")
        return allowed

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarDeadEnd(f"the grammar refused token {token}: {self._matcher.get_error()}")


class GrammarCompiler:
    """Compiles GuidedDecoding messages for one tokenizer (built into llguidance's form once,
    on first use: about 0.2 s for a 49k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size

    @cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab_size,
                                      eos_token=self._tokenizer.eos_token_id)

    def compile(self, spec: GuidedSpec | None) -> Grammar | None:
        """The grammar `spec` asks for (None when it asks for none); ValueError says what is wrong."""
        if spec is None:
            return None
        kind = spec.kind
        if kind == "json_schema":
            schema = _json_schema(spec.value)
            try:
                source = json_schema_grammar(schema)
            except ValueError as exc:
                raise ValueError(f"guided.json_schema is not a usable grammar: {exc}") from None
        elif kind == "json_object":
            if spec.value is not True:
                raise ValueError("guided.json_object must be true when set")
            source = json_schema_grammar({"type": "object"})
        elif kind == "regex":
            _check_size(spec.value, "guided.regex")
            source = unpanicked(lambda: llguidance.LLMatcher.grammar_from_regex(spec.value))
        else:
            choices = list(spec.value)
            if not choices or any(c == "" for c in choices):
                raise ValueError("guided.choice needs at least one non-empty string")
            _check_size(json.dumps(choices), "guided.choice")
            source = unpanicked(lambda: llguidance.grammar_from("choice", json.dumps(choices)))
        is_error, messages = unpanicked(
            lambda: llguidance.LLMatcher.validate_grammar_with_warnings(source, self._lltokenizer))
        if is_error:
            raise ValueError(f"guided.{kind} is not a usable grammar: {messages[0]}")
        return Grammar(source, self._lltokenizer, spec)


def _check_size(text: str, name: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")


def _json_schema(text: str) -> dict:
    _check_size(text, "guided.json_schema")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"guided.json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("guided.json_schema must be a JSON object (a JSON Schema)")
    return schema
