"""Chat `messages` -> duet.v1 ChatMessages, every key of every message checked.

A message is `{role, content}`; an assistant message may also carry the `tool_calls` it made,
and a `tool` message carries `tool_call_id`, the call whose result is its content. A key that
asks for something duet cannot render (`name`, audio, a refusal, ...) is a 400 naming it.
"""
from __future__ import annotations

import json
from typing import Any

from common.openai_http.api_errors import ApiError, refuse_unknown_keys
from protos.duet.v1 import duet_pb2 as pb

# The keys each role's messages may carry beyond role and content; others are refused unless null.
_EXTRA_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def chat_messages(body: dict) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("messages must be a non-empty list of {role, content} objects", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, name: str) -> pb.ChatMessage:
    if not isinstance(message, dict):
        raise ApiError.invalid(f"{name} must be an object with role and content", param=name)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError.invalid(f"{name}.role must be a non-empty string", param=f"{name}.role")
    allowed = {"role", "content"} | _EXTRA_KEYS.get(role, set())
    for key, value in message.items():
        if key not in allowed and value is not None:
            raise ApiError.invalid(f"{name}.{key} is not supported in a {role!r} message by this server",
                                   param=f"{name}.{key}")
    out = pb.ChatMessage(role=role, content=message_text(message.get("content"), f"{name}.content"))
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ApiError.invalid(f"{name}.tool_calls must be a list of function calls", param=f"{name}.tool_calls")
        out.tool_calls.extend(_tool_call(c, f"{name}.tool_calls[{j}]") for j, c in enumerate(calls))
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError.invalid(f"{name}.tool_call_id must be the id of the call this message answers",
                                   param=f"{name}.tool_call_id")
        out.tool_call_id = call_id
    return out


def _tool_call(call: Any, name: str) -> pb.ToolCall:
    """`{id, type: "function", function: {name, arguments}}`, arguments a JSON object as text; the
    `index` a streamed call was assembled by may come along (the call's position, nothing to do)."""
    if not isinstance(call, dict):
        raise ApiError.invalid(f"{name} must be an object with id, type and function", param=name)
    refuse_unknown_keys(call, {"id", "type", "function", "index"}, name)
    if not isinstance(call.get("index", 0), int):
        raise ApiError.invalid(f"{name}.index must be an integer", param=f"{name}.index")
    if call.get("type", "function") != "function":
        raise ApiError.invalid(f"{name}.type must be 'function'", param=f"{name}.type")
    call_id, function = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError.invalid(f"{name}.id must be a non-empty string", param=f"{name}.id")
    if not isinstance(function, dict):
        raise ApiError.invalid(f"{name}.function must be an object with name and arguments", param=f"{name}.function")
    # parsed_arguments: the `openai` client's own parse of arguments, sent back with its message
    refuse_unknown_keys(function, {"name", "arguments", "parsed_arguments"}, f"{name}.function")
    function_name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(function_name, str) or not function_name:
        raise ApiError.invalid(f"{name}.function.name must be a non-empty string", param=f"{name}.function.name")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError.invalid(f"{name}.function.arguments must be a JSON object as a string",
                               param=f"{name}.function.arguments")
    return pb.ToolCall(id=call_id, name=function_name, arguments=arguments)


def message_text(content: Any, name: str) -> str:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError.invalid(f"{name} must be a string or a list of text parts (other part types are not "
                           "supported)", param=name)

