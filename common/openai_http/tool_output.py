"""A chat answer generated with tools -> OpenAI's `message.tool_calls`, or `delta.tool_calls` events.

Forced calls (tools.py) parse by construction: a named function's output is its arguments,
streamed as they come; "required" output is a JSON list of calls, sent once it is complete.
Under "auto" the answer is read with the `--tool-call-parser`, `hermes` (the only one now):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the last may lack its closing
tag. Text before the first block is the content, and an answer whose blocks do not all parse as
calls of the request's tools (whose arguments validate, for `strict` tools) is plain content,
whole. A streamed answer's text goes out as content until a block may be starting, then is held
until the answer ends.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import jsonschema

from common.openai_http.tools import ToolMode, ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object as text
    id: str = ""

    def entry(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: str) -> Call:
    return Call(name, arguments, "call_" + uuid.uuid4().hex[:24])


def parse_hermes(text: str, plan: ToolPlan) -> tuple[str | None, list[Call]] | None:
    """(content before the calls, the calls), or None when `text` holds no call that parses."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls = []
    for block in _BLOCK.finditer(text, start):
        call = _hermes_call(block.group(1), plan)
        if call is None:
            return None
        calls.append(call)
    if _BLOCK.sub("", text[start:]).strip():
        return None  # text between or after the blocks: not an answer of calls
    return text[:start].strip() or None, calls if plan.parallel else calls[:1]


def _hermes_call(body: str, plan: ToolPlan) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if name not in plan.parameters or not isinstance(arguments, dict):
        return None
    if name in plan.strict:
        try:
            jsonschema.validate(arguments, plan.parameters[name])
        except (jsonschema.ValidationError, jsonschema.SchemaError):
            return None
    return new_call(name, json.dumps(arguments))


# --tool-call-parser: how an "auto" answer is read for calls.
TOOL_CALL_PARSERS = {"hermes": parse_hermes}
DEFAULT_TOOL_CALL_PARSER = "hermes"


def parse_required(text: str) -> list[Call] | None:
    """A complete "required" answer (a JSON list of {name, arguments}) as calls."""
    try:
        return [new_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return None


class ToolAnswer:
    """One choice's answer: its message when complete, or its stream's deltas."""

    def __init__(self, plan: ToolPlan, parser: str = DEFAULT_TOOL_CALL_PARSER) -> None:
        self.plan = plan
        self._parse = TOOL_CALL_PARSERS[parser]
        self._text = ""  # generated so far and not yet sent as content
        self._named: Call | None = None  # NAMED, streamed: the call whose arguments are going out

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's `message` and finish reason."""
        content, calls = self._calls(text, finish_reason)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.entry() for c in calls]
        return message, _reason(calls, finish_reason)

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the answer's next piece, lets go out now."""
        if self.plan.mode is ToolMode.NAMED:
            deltas = []
            if self._named is None:
                self._named = new_call(self.plan.forced, "")
                deltas.append({"tool_calls": [{"index": 0, **self._named.entry()}]})
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        self._text += text
        if self.plan.mode is ToolMode.REQUIRED:
            return []
        start = self._text.find(OPEN)
        if start >= 0:  # from the first block on, held until the end
            return self._content(self._text[:start], keep=self._text[start:])
        cut = len(self._text) - _open_tag_started(self._text)
        return self._content(self._text[:cut], keep=self._text[cut:])

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas once the answer is complete, and its finish reason."""
        if self.plan.mode is ToolMode.NAMED:
            return self.feed("") if self._named is None else [], _reason([self._named], finish_reason)
        held, self._text = self._text, ""
        _, calls = self._calls(held, finish_reason)  # the content before any call went out already
        deltas = [{"tool_calls": [{"index": i, **c.entry()} for i, c in enumerate(calls)]}] if calls else []
        if not calls and held:
            deltas.insert(0, {"content": held})
        return deltas, _reason(calls, finish_reason)

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[Call]]:
        if self.plan.mode is ToolMode.NAMED:
            return None, [new_call(self.plan.forced, text)]
        if self.plan.mode is ToolMode.REQUIRED:
            calls = parse_required(text) if finish_reason == "stop" else None
            return (None, calls) if calls else (text, [])
        parsed = self._parse(text, self.plan)
        return parsed if parsed is not None else (text, [])

    def _content(self, ready: str, keep: str) -> list[dict]:
        """Send `ready` as content unless it is only whitespace (which may precede a call)."""
        if not ready.strip():
            self._text = ready + keep
            return []
        self._text = keep
        return [{"content": ready}]


def _open_tag_started(text: str) -> int:
    """How many characters at the end of `text` could be the start of a `<tool_call>` tag."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)


def _reason(calls: list[Call], finish_reason: str | None) -> str | None:
    """`tool_calls` for an answer of calls that ended by itself; `length` stays `length`."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
