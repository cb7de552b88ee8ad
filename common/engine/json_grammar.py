"""The llguidance grammar of a JSON Schema, as guided decoding compiles it and the HTTP front
checks a strict tool's parameters with it (without the sampler, and torch)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import llguidance

T = TypeVar("T")

# JSON with the whitespace models learned (newlines and indentation), bounded: wherever JSON
# allows whitespace the grammar admits at most one line break followed by at most
# MAX_JSON_INDENT spaces or tabs (llguidance matches `whitespace_pattern` at most once per place),
# so a model can neither pad with blank lines nor with endless blanks. Without whitespace at all a
# small model is pushed off what it learned and loops (`{"name":{"description":{...`).
MAX_JSON_INDENT = 16
JSON_WHITESPACE = rf"(\x0D?\x0A)?[\x20\x09]{{0,{MAX_JSON_INDENT}}}"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of a JSON Schema, with the bounded whitespace above (a schema's own
    top-level `x-guidance` settings take precedence); ValueError says why llguidance cannot use it."""
    grammar = unpanicked(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
    is_error, messages = unpanicked(lambda: llguidance.LLMatcher.validate_grammar_with_warnings(grammar))
    if is_error:
        raise ValueError(messages[0])
    return grammar


def unpanicked(call: Callable[[], T]) -> T:
    """`call()` into llguidance, a Rust panic in it as a ValueError: pyo3 raises a panic as its
    PanicException, a BaseException that `except Exception` would let through (fuzzing found
    one: a schema whose error message llguidance cut inside a multi-byte character)."""
    try:
        return call()
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ValueError(f"llguidance failed on it: {exc}") from None
