"""A GenerateRequest's chat messages and function tools -> the chat template's inputs.

A template that takes `tools` (`Tokenizer.takes_tools`) gets the tools and the messages as
OpenAI's API shapes them (assistant `tool_calls`, `tool` messages with `tool_call_id`), the calls'
arguments as objects, as transformers passes them. Any other template gets plain messages in the
Hermes format every tool-trained open model knows, which the front's `hermes` parser reads back:
- the tools, in a system message (appended to the conversation's own system message if it has one):
  TOOLS_PREAMBLE, one `{"type": "function", "function": {...}}` per line inside <tools></tools>,
  then TOOLS_INSTRUCTIONS;
- an assistant's calls, after its content: one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  block per call;
- a `tool` message, as a message of role `tool` holding the result (without its call's id).
"""
from __future__ import annotations

import json

from common.errors import InvalidArgument
from protos.duet.v1 import duet_pb2 as pb

TOOLS_PREAMBLE = "You can call the following functions to help with the request."
TOOLS_INSTRUCTIONS = ("To call a function, answer with one block per call:\n"
                      '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n</tool_call>\n'
                      "Once a message of the role tool has brought the result, answer the user with it.")


def template_inputs(request: pb.GenerateRequest, takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and the tools (None: no `tools` variable) to render `request` with."""
    if takes_tools:
        return [_native(m) for m in request.messages], [tool_dict(t) for t in request.tools] or None
    messages = _plain(request.messages)
    if request.tools:
        system = "\n".join([TOOLS_PREAMBLE, "<tools>", *(json.dumps(tool_dict(t)) for t in request.tools),
                            "</tools>", TOOLS_INSTRUCTIONS])
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{system}"}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return messages, None


def tool_dict(tool: pb.FunctionTool) -> dict:
    """A FunctionTool as OpenAI's `tools[]` entry."""
    function = {"name": tool.name, "description": tool.description,
                "parameters": _json(tool.parameters, f"tools '{tool.name}' parameters") if tool.parameters
                else {"type": "object"}}
    return {"type": "function", "function": function}


def _native(message: pb.ChatMessage) -> dict:
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c)}} for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _plain(messages) -> list[dict]:
    out = []
    for m in messages:
        calls = [f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': _arguments(c)})}\n</tool_call>"
                 for c in m.tool_calls]
        out.append({"role": m.role, "content": "\n".join([m.content, *calls] if m.content else calls)})
    return out


def _arguments(call: pb.ToolCall) -> dict:
    arguments = _json(call.arguments or "{}", f"tool call '{call.id}' arguments")
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"tool call '{call.id}' arguments must be a JSON object")
    return arguments


def _json(text: str, name: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python parses
        raise InvalidArgument(f"{name} are not valid JSON: {exc}") from None
