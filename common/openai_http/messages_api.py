"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path.

A Messages body is translated into the Chat Completions body it means (`chat_body`): `system`
the system message, `tool_use` blocks an assistant's tool calls, `tool_result` blocks the `tool`
messages answering them, `tools` with `input_schema` chat's function tools, `tool_choice`
auto / any / tool / none chat's auto / required / a named function / none. From there the
request takes the one chat path, and `MessagesShaper` turns the chat answer into a Message or
Anthropic's event sequence. Errors take Anthropic's shape (`ApiError.anthropic_body`).

Claude Code opens its system prompt with a per-request line, `x-anthropic-billing-header: ...`,
whose value changes every turn: left in, it would end the prompt's shared prefix at its first
line, and no turn would find the previous one in the prefix cache. Unless the daemon runs with
`--anthropic-billing-header keep`, such a line is dropped before the prompt is rendered.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from common.openai_http.api_errors import ApiError, named_items, refuse_unknown_keys
from common.openai_http.request_mapping import HONOURED, NOTHING, MappedRequest, get_value, \
    refuse_unsupported
from common.openai_http.response_shaping import ResponseShaper
from protos.duet.v1 import duet_pb2 as pb

BILLING_HEADER = "x-anthropic-billing-header:"
BILLING_HEADER_CHOICES = ("strip", "keep")
# Every field of a Messages request -> HONOURED, ANY_TEXT, or the values that ask for nothing.
FIELDS: dict[str, Any] = {
    "model": HONOURED, "max_tokens": HONOURED, "messages": HONOURED, "system": HONOURED, "tools": HONOURED,
    "tool_choice": HONOURED, "stop_sequences": HONOURED, "temperature": HONOURED, "top_p": HONOURED,
    "top_k": HONOURED, "stream": HONOURED, "output_config": HONOURED, "metadata": HONOURED,
    "cache_control": HONOURED,  # the prefix cache keeps every prompt's blocks without being asked
    "thinking": (None, {"type": "disabled"}), "service_tier": (None, "auto", "standard_only"),
    "container": NOTHING, "diagnostics": NOTHING, "inference_geo": NOTHING, "speed": NOTHING,
    "user_profile_id": NOTHING, "workspace_id": NOTHING, "mcp_servers": NOTHING,
}
# /v1/messages/count_tokens: the fields that shape the prompt.
COUNT_TOKENS_FIELDS = {**{k: FIELDS[k] for k in ("model", "messages", "system", "tools", "tool_choice",
                                                 "cache_control", "thinking", "output_config", "speed",
                                                 "user_profile_id", "workspace_id")}, "output_format": NOTHING}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn or stop_sequence
_CACHE_CONTROL = "cache_control"


def chat_body(body: Any, strip_billing_header: bool = True, fields: dict[str, Any] = FIELDS) -> dict:
    """The Chat Completions body a Messages request means; ApiError names what is wrong."""
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    refuse_unsupported(body, fields)
    messages = []
    system = _system(body.get("system"), strip_billing_header)
    if system:
        messages.append({"role": "system", "content": system})
    messages += _messages(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages}
    if "max_tokens" in fields:  # a generation's, not count_tokens'
        if body.get("max_tokens") is None:
            raise ApiError.invalid("max_tokens is required", param="max_tokens")
        chat["max_completion_tokens"] = get_value(body, "max_tokens", int, check=lambda v: v >= 1,
                                                  need="an integer >= 1")
    for name in ("model", "temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    stop = get_value(body, "stop_sequences", list, [])
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError.invalid("stop_sequences must be a list of non-empty strings", param="stop_sequences")
    if stop:
        chat["stop"] = stop
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    response_format = _format(get_value(body, "output_config", dict, {}))
    if response_format is not None:
        chat["response_format"] = response_format
    metadata = get_value(body, "metadata", dict, {})
    refuse_unknown_keys(metadata, {"user_id"}, "metadata")
    get_value(metadata, "user_id", str, name="metadata.user_id")
    if isinstance(body.get(_CACHE_CONTROL), dict):
        _cache_control(body[_CACHE_CONTROL], _CACHE_CONTROL)
    elif body.get(_CACHE_CONTROL) is not None:
        raise ApiError.invalid("cache_control must be {\"type\": \"ephemeral\"}", param=_CACHE_CONTROL)
    return chat


def _system(system: Any, strip_billing_header: bool) -> str:
    """`system`: a string or a list of text blocks (joined by newlines)."""
    if system is None:
        return ""
    if isinstance(system, list):
        system = "\n".join(_text_block(block, f"system[{i}]") for i, block in enumerate(system))
    elif not isinstance(system, str):
        raise ApiError.invalid("system must be a string or a list of text blocks", param="system")
    if strip_billing_header:
        system = "\n".join(line for line in system.split("\n") if not line.startswith(BILLING_HEADER))
    return system.strip("\n")


def _messages(messages: Any) -> list[dict]:
    out: list[dict] = []
    calls: set[str] = set()
    for name, message in named_items(messages, "messages", "a non-empty list of {role, content} objects",
                                     non_empty=True):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ApiError.invalid(f"{name} must be an object whose role is 'user' or 'assistant'",
                                   param=f"{name}.role")
        refuse_unknown_keys(message, {"role", "content"}, name)
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list) and content:
            out += _user_blocks(content, name, calls) if message["role"] == "user" else \
                [_assistant_blocks(content, name, calls)]
        else:
            raise ApiError.invalid(f"{name}.content must be a string or a non-empty list of content blocks",
                                   param=f"{name}.content")
    return out


def _user_blocks(blocks: list, name: str, calls: set[str]) -> list[dict]:
    """A user turn: each `tool_result` block a `tool` message, then its text as a user message."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{name}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            refuse_unknown_keys(block, {"type", "tool_use_id", "content", "is_error", _CACHE_CONTROL}, at)
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise ApiError.invalid(f"{at}.tool_use_id {call_id!r} answers no tool_use block before it",
                                       param=f"{at}.tool_use_id")
            result = block.get("content", "")
            if isinstance(result, list):
                result = "\n".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(result))
            elif not isinstance(result, str):
                raise ApiError.invalid(f"{at}.content must be a string or a list of text blocks", param=f"{at}.content")
            if block.get("is_error") not in (None, False, True):
                raise ApiError.invalid(f"{at}.is_error must be a boolean", param=f"{at}.is_error")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": f"Error: {result}" if block.get("is_error") else result})
        else:
            texts.append(_text_block(block, at))
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_blocks(blocks: list, name: str, calls: set[str]) -> dict:
    """An assistant turn: its text blocks the content, its `tool_use` blocks the tool calls."""
    texts, tool_calls = [], []
    for j, block in enumerate(blocks):
        at = f"{name}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_use":
            refuse_unknown_keys(block, {"type", "id", "name", "input", _CACHE_CONTROL}, at)
            call_id, function, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(function, str):
                raise ApiError.invalid(f"{at} must have a string id and name", param=at)
            if not isinstance(arguments, dict):
                raise ApiError.invalid(f"{at}.input must be an object", param=f"{at}.input")
            calls.add(call_id)
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": function, "arguments": json.dumps(arguments)}})
        else:
            texts.append(_text_block(block, at))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _text_block(block: Any, name: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise ApiError.invalid(f"{name} must be a text block (a {kind!r} block is not supported here)", param=name)
    refuse_unknown_keys(block, {"type", "text", _CACHE_CONTROL, "citations"}, name)
    if block.get("citations"):
        raise ApiError.invalid(f"{name}.citations is not supported by this server", param=f"{name}.citations")
    if block.get(_CACHE_CONTROL) is not None:
        _cache_control(block[_CACHE_CONTROL], f"{name}.{_CACHE_CONTROL}")
    return block["text"]


def _cache_control(value: Any, name: str) -> None:
    """A cache breakpoint: the prefix cache keeps every prompt's pages anyway, for as long as it can."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise ApiError.invalid(f"{name} must be {{\"type\": \"ephemeral\"}}", param=name)
    refuse_unknown_keys(value, {"type", "ttl"}, name)


def _tools(tools: Any) -> list[dict]:
    """Anthropic's client tools `{name, description, input_schema}` as chat's function tools."""
    out = []
    for name, tool in named_items(tools, "tools", "a list of tools"):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            raise ApiError.invalid(f"{name} must be a client tool {{\"name\", \"description\", \"input_schema\"}} "
                                   "(server tools are not supported)", param=name)
        refuse_unknown_keys(tool, {"type", "name", "description", "input_schema", _CACHE_CONTROL, "strict"}, name)
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict:
    """`{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}` -> chat's
    `tool_choice` and `parallel_tool_calls`."""
    kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str) or choice["type"] not in kinds:
        raise ApiError.invalid("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    refuse_unknown_keys(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    chat: dict[str, Any] = {"tool_choice": kinds[choice["type"]] or {"type": "function",
                                                                    "function": {"name": choice.get("name")}}}
    disable = get_value(choice, "disable_parallel_tool_use", bool, name="tool_choice.disable_parallel_tool_use")
    if disable is not None:
        chat["parallel_tool_calls"] = not disable
    return chat


def _format(config: dict) -> dict | None:
    """`output_config.format` ({"type": "json_schema", "schema"}) -> chat's `response_format`."""
    refuse_unknown_keys(config, {"format", "effort"}, "output_config")
    if config.get("effort") is not None:
        raise ApiError.invalid("output_config.effort is not supported by this server", param="output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError.invalid("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                               param="output_config.format")
    refuse_unknown_keys(fmt, {"type", "schema"}, "output_config.format")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


class MessagesShaper:
    """The chat answer of a Messages request as a Message, or as Anthropic's server-sent events."""

    named_events = True  # Anthropic's clients read each event's `event:` line
    end_of_stream = b""  # message_stop ends the stream

    def __init__(self, request: MappedRequest, model: str, tool_call_parser: str) -> None:
        self.chat = ResponseShaper(request, model, tool_call_parser)
        self.id = "msg_" + request.request_id
        self.model = model
        self.content: list[dict] = []  # the content blocks, the last one open while streaming
        self._open: dict | None = None
        self._finish_reason: str | None = None  # the chat answer's: "tool_calls" when it called tools

    def response(self, chunks: Iterable[pb.GenerationChunk]) -> dict:
        choice = self.chat.response(chunks)["choices"][0]
        message = choice["message"]
        if message.get("content"):
            self.content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            self.content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                 "input": json.loads(call["function"]["arguments"])})
        self._finish_reason = choice["finish_reason"]
        return {**self._message(), "content": self.content, **self._stop(), "usage": self._usage()}

    def opening(self) -> Iterator[dict]:
        yield {"type": "message_start", "message": {**self._message(), "content": [], "stop_reason": None,
                                                     "stop_sequence": None,
                                                     "usage": {"input_tokens": 0, "output_tokens": 0}}}
        yield {"type": "ping"}

    def events(self, chunk: pb.GenerationChunk) -> Iterator[dict]:
        for event in self.chat.events(chunk):
            choice = event["choices"][0]
            delta = choice.get("delta", {})
            if delta.get("content"):
                if self._open is None or self._open["type"] != "text":
                    yield from self._start({"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    yield from self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                            "input": {}})
                arguments = call.get("function", {}).get("arguments")
                if arguments:
                    yield self._delta({"type": "input_json_delta", "partial_json": arguments})
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]

    def closing(self) -> Iterator[dict]:
        yield from self._stop_block()
        usage = self._usage()
        yield {"type": "message_delta", "delta": self._stop(), "usage": usage}
        yield {"type": "message_stop"}

    def failure(self, error: ApiError) -> dict:
        return error.anthropic_body()

    def _start(self, block: dict) -> Iterator[dict]:
        yield from self._stop_block()
        self._open = block
        self.content.append(block)
        yield {"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _stop_block(self) -> Iterator[dict]:
        if self._open is not None:
            self._open = None
            yield {"type": "content_block_stop", "index": len(self.content) - 1}

    def _message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _stop(self) -> dict:
        """`stop_reason`: end_turn, max_tokens, stop_sequence (and which) or tool_use."""
        stop_string = self.chat.choices.stop_strings[0]
        reason = _STOP_REASONS.get(self._finish_reason) or ("stop_sequence" if stop_string else "end_turn")
        return {"stop_reason": reason, "stop_sequence": stop_string if reason == "stop_sequence" else None}

    def _usage(self) -> dict:
        """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""
        usage = self.chat.choices.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": usage["completion_tokens"]}
