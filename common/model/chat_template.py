"""Chat templates rendered as transformers renders them, in jinja's immutable sandbox, with bounds.

A template comes with the model's files, which a user may have downloaded from anywhere, and it
runs on every chat request: it is untrusted code. The sandbox keeps it from Python's internals;
it does not bound its time or memory (`{% for a in range(99999) %}{% for b in range(99999) %}`
runs for minutes, `{{ 'a' * 2000000000 }}` takes 2 GB). So one render here may create ranges of
at most `MAX_RANGE_ITEMS` items in all, `*` and `**` may not build a value past
`MAX_RENDERED_CHARS` (or a power past `MAX_EXPONENT`), and the rendered text may not grow past
`MAX_RENDERED_CHARS`: past a bound the render stops with a `SecurityError` naming it, which the
request gets as INVALID_ARGUMENT. What else a template loops over is the conversation itself,
which the request's own size bounds.
"""
from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE_ITEMS = 1_000_000  # range() items one render may create, all calls together
MAX_RENDERED_CHARS = 8_000_000  # a rendered prompt, and any one value `*` builds
MAX_EXPONENT = 4096

_range_items_left: ContextVar[list[int]] = ContextVar("range_items_left")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the chat template raises to the power {right}: more than {MAX_EXPONENT}")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the chat template builds a value of {len(seq) * times} items: "
                                        f"more than {MAX_RENDERED_CHARS}")
        return super().call_binop(context, operator, left, right)


def _counted_range(*args: int) -> range:
    items = range(*args)
    left = _range_items_left.get()
    left[0] -= len(items)
    if left[0] < 0:
        raise SecurityError(f"the chat template creates ranges of more than {MAX_RANGE_ITEMS} items")
    return items


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja environment transformers renders chat templates in, bounded."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _counted_range
    return env


class ChatTemplate:
    """A chat template compiled once; `TemplateSyntaxError` when it does not parse."""

    def __init__(self, source: str) -> None:
        env = _environment()
        self.variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        self._template = env.from_string(source)

    def render(self, **variables: Any) -> str:
        """The rendered text; `SecurityError` past a bound, the template's own errors as raised."""
        token = _range_items_left.set([MAX_RANGE_ITEMS])
        try:
            parts, size = [], 0
            for part in self._template.generate(**variables):
                size += len(part)
                if size > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the chat template renders more than {MAX_RENDERED_CHARS} characters")
                parts.append(part)
            return "".join(parts)
        finally:
            _range_items_left.reset(token)
