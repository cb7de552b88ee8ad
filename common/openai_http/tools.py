"""`tools`, `tool_choice` and `parallel_tool_calls` -> the functions offered in the prompt, and
for a forced call the grammar that makes it exact.

- `"none"` (the default without tools): the tools are not offered; plain text.
- `"auto"` (the default with tools): offered in the prompt; the answer is read for Hermes-format
  calls (tool_output.py), else it is plain content.
- `"required"`: generated under the JSON Schema of a list of `{"name", "arguments"}` objects, one
  of the tools each, at least one (exactly one when `parallel_tool_calls` is false).
- `{"type": "function", "function": {"name": N}}`: generated under N's `parameters` schema: the
  output is the arguments of one call of N.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from common.engine.json_grammar import json_schema_grammar
from common.openai_http.api_errors import ApiError, refuse_unknown_keys
from protos.duet.v1 import duet_pb2 as pb

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ANY_OBJECT = {"type": "object"}
_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point to


class ToolMode(Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """How the answer of a request with tools is generated and read."""

    mode: ToolMode
    parameters: dict[str, dict]  # each tool's name -> its arguments' JSON Schema, in request order
    strict: frozenset[str]  # tools whose calls are returned under "auto" only when their arguments validate
    parallel: bool  # more than one call per answer
    forced: str | None = None  # NAMED: the function called

    def guided(self) -> pb.GuidedDecoding | None:
        """The grammar of a forced call (None under auto)."""
        if self.mode is ToolMode.NAMED:
            return pb.GuidedDecoding(json_schema=json.dumps(self.parameters[self.forced]))
        if self.mode is ToolMode.AUTO:
            return None
        return pb.GuidedDecoding(json_schema=json.dumps(_calls_schema(self.parameters, self.parallel)))


def tool_plan(body: dict) -> tuple[ToolPlan | None, list[pb.FunctionTool]]:
    """The plan (None: answer in plain text) and the tools to offer in the prompt."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError.invalid("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    tools, strict = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    forced = None
    if isinstance(choice, dict):
        forced = _named(choice)
        mode = ToolMode.NAMED
    elif choice in ("auto", "required"):
        mode = ToolMode(choice)
    elif choice == "none":
        return None, []
    else:
        raise ApiError.invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                               "\"function\": {\"name\": ...}}", param="tool_choice")
    if not tools:
        raise ApiError.invalid("tool_choice other than 'none' needs tools", param="tool_choice")
    parameters = {t.name: json.loads(t.parameters) for t in tools}
    if forced is not None and forced not in parameters:
        raise ApiError.invalid(f"tool_choice names the function '{forced}', which is not among tools",
                               param="tool_choice.function.name")
    if mode is not ToolMode.AUTO and body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError.invalid("response_format cannot be combined with a forced tool call (tool_choice 'required' "
                               "or a named function): the call's schema is the format", param="response_format")
    plan = ToolPlan(mode, parameters, strict, parallel is not False, forced)
    if mode is ToolMode.REQUIRED:
        _check_schema(_calls_schema(parameters, plan.parallel), "tools")
    return plan, tools


def _tools(tools: Any) -> tuple[list[pb.FunctionTool], frozenset[str]]:
    if tools is None:
        return [], frozenset()
    if not isinstance(tools, list):
        raise ApiError.invalid("tools must be a list of function tools", param="tools")
    out, strict = [], set()
    for i, tool in enumerate(tools):
        name = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError.invalid(f"{name} must be {{\"type\": \"function\", \"function\": {{...}}}} (only "
                                   "function tools are supported)", param=name)
        refuse_unknown_keys(tool, {"type", "function"}, name)
        function = tool["function"]
        refuse_unknown_keys(function, {"name", "description", "parameters", "strict"}, f"{name}.function")
        function_name = function.get("name")
        if not isinstance(function_name, str) or not _NAME.fullmatch(function_name):
            raise ApiError.invalid(f"{name}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                                   param=f"{name}.function.name")
        if any(t.name == function_name for t in out):
            raise ApiError.invalid(f"{name}.function.name '{function_name}' is given twice",
                                   param=f"{name}.function.name")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ApiError.invalid(f"{name}.function.description must be a string",
                                   param=f"{name}.function.description")
        parameters = function.get("parameters") or _ANY_OBJECT
        if not isinstance(parameters, dict):
            raise ApiError.invalid(f"{name}.function.parameters must be a JSON Schema object",
                                   param=f"{name}.function.parameters")
        _check_schema(parameters, f"{name}.function.parameters")
        if function.get("strict") not in (None, True, False):
            raise ApiError.invalid(f"{name}.function.strict must be a boolean", param=f"{name}.function.strict")
        if function.get("strict"):
            strict.add(function_name)
        out.append(pb.FunctionTool(name=function_name, description=description, parameters=json.dumps(parameters)))
    return out, frozenset(strict)


def _named(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError.invalid("tool_choice must name a function as {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", param="tool_choice")
    refuse_unknown_keys(choice, {"type", "function"}, "tool_choice")
    refuse_unknown_keys(function, {"name"}, "tool_choice.function")
    return function["name"]


def _calls_schema(parameters: dict[str, dict], parallel: bool) -> dict:
    """A list of calls, each `{"name": one of the tools, "arguments": that tool's schema}`. The
    tools' own definitions move to the top, where their `#/$defs/...` references look."""
    definitions: dict[str, dict] = {}
    calls = []
    for name, schema in parameters.items():
        schema = dict(schema)
        for key in _DEFINITIONS:
            for ref, target in (schema.pop(key, None) or {}).items():
                if definitions.setdefault(key, {}).setdefault(ref, target) != target:
                    raise ApiError.invalid(f"the tools' parameters define '{key}/{ref}' differently: a forced call "
                                           "needs their definitions to agree", param="tools")
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **definitions}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_schema(schema: dict, param: str) -> None:
    try:
        json_schema_grammar(schema)
    except ValueError as exc:
        raise ApiError.invalid(f"{param} is not a JSON Schema this server can generate under: {exc}",
                               param=param) from None

