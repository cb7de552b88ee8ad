"""OpenAI's Responses API (`POST /v1/responses`, `/v1/responses/input_tokens`) over the chat path.

A Responses body is translated into the Chat Completions body it means (`chat_body`): its
`input` items become chat messages (a `function_call` item an assistant's tool call, a
`function_call_output` item the `tool` message answering it), `instructions` the system
message, its flat function tools chat's nested ones, `text.format` the `response_format`. From
there the request takes the one chat path (request_mapping.py, the chat template, sampling,
tools, guided decoding), and `ResponsesShaper` turns the chat answer, whole or streamed, into a
Response object or the Responses event sequence.

Stateless: nothing is stored, so `store: true`, `previous_response_id` and `conversation` are
refused by name.
"""
from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from common.openai_http.api_errors import ApiError, named_items, refuse_unknown_keys
from common.openai_http.request_mapping import ANY_TEXT, HONOURED, NOTHING, MappedRequest, get_value, \
    refuse_unsupported
from common.openai_http.response_shaping import ResponseShaper
from protos.duet.v1 import duet_pb2 as pb

_NOT_KEPT = "this server keeps no responses (it is stateless): send the whole conversation as `input`"
# Every field of a Responses request -> HONOURED, ANY_TEXT, or the values that ask for nothing.
FIELDS: dict[str, Any] = {
    "model": HONOURED, "input": HONOURED, "instructions": HONOURED, "tools": HONOURED, "tool_choice": HONOURED,
    "parallel_tool_calls": HONOURED, "max_output_tokens": HONOURED, "temperature": HONOURED, "top_p": HONOURED,
    "text": HONOURED, "stream": HONOURED, "metadata": HONOURED, "store": (None, False),
    "user": ANY_TEXT, "safety_identifier": ANY_TEXT, "prompt_cache_key": ANY_TEXT,  # the prefix cache needs no hint
    "include": (None, [], ["reasoning.encrypted_content"]),  # no reasoning items are produced: nothing to include
    "reasoning": (None, {}, {"effort": None}, {"effort": "none"}), "truncation": (None, "disabled"),
    "top_logprobs": (None, 0), "service_tier": (None, "auto", "default"), "background": (None, False),
    "previous_response_id": NOTHING, "conversation": NOTHING, "prompt": NOTHING, "max_tool_calls": NOTHING,
    "stream_options": NOTHING, "prompt_cache_retention": NOTHING, "prompt_cache_options": NOTHING,
    "moderation": NOTHING, "context_management": NOTHING, "image": NOTHING, "access_programs": NOTHING,
}
# /v1/responses/input_tokens: the fields that shape the prompt.
INPUT_TOKENS_FIELDS = {k: FIELDS[k] for k in ("model", "input", "instructions", "tools", "tool_choice",
                                              "parallel_tool_calls", "text", "reasoning", "truncation",
                                              "previous_response_id", "conversation")}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


def chat_body(body: Any, fields: dict[str, Any] = FIELDS) -> dict:
    """The Chat Completions body a Responses request means; ApiError names what is wrong."""
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    if body.get("store"):
        raise ApiError.invalid(f"store must be false or absent: {_NOT_KEPT}", param="store")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise ApiError.invalid(f"{name} is not supported: {_NOT_KEPT}", param=name)
    refuse_unsupported(body, fields)
    messages = []
    instructions = get_value(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    max_output = get_value(body, "max_output_tokens", int, check=lambda v: v >= 1, need="an integer >= 1")
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _format(get_value(body, "text", dict, {}))
    if response_format is not None:
        chat["response_format"] = response_format
    _metadata(body)
    return chat


def _messages(items: Any) -> list[dict]:
    """`input`: a string (one user message) or a list of items, in order."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    calls: set[str] = set()
    for name, item in named_items(items, "input", "a non-empty string or a non-empty list of items", non_empty=True):
        if not isinstance(item, dict):
            raise ApiError.invalid(f"{name} must be an object", param=name)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, name))
        elif kind == "function_call":
            # parsed_arguments: the `openai` client's own parse of arguments, sent back with its item
            refuse_unknown_keys(item, {"type", "id", "call_id", "name", "arguments", "status", "parsed_arguments"}, name)
            call = {"id": _text(item, "call_id", name), "type": "function",
                    "function": {"name": _text(item, "name", name), "arguments": _text(item, "arguments", name)}}
            calls.add(call["id"])
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            refuse_unknown_keys(item, {"type", "id", "call_id", "output", "status"}, name)
            call_id = _text(item, "call_id", name)
            if call_id not in calls:
                raise ApiError.invalid(f"{name}.call_id '{call_id}' answers no function_call item before it",
                                       param=f"{name}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _content(item.get("output"), f"{name}.output")})
        else:
            raise ApiError.invalid(f"{name}.type '{kind}' is not supported (only message, function_call and "
                                   "function_call_output items)", param=f"{name}.type")
    return messages


def _message(item: dict, name: str) -> dict:
    refuse_unknown_keys(item, {"type", "id", "role", "content", "status"}, name)
    role = item.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise ApiError.invalid(f"{name}.role must be one of {', '.join(_ROLES)}", param=f"{name}.role")
    return {"role": role, "content": _content(item.get("content"), f"{name}.content")}


def _content(content: Any, name: str) -> str:
    """A string, or a list of input_text / output_text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ApiError.invalid(f"{name}[{j}] must be an input_text or output_text part (other parts are not "
                                       "supported)", param=f"{name}[{j}]")
            refuse_unknown_keys(part, {"type", "text", "annotations", "logprobs", "parsed"}, f"{name}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError.invalid(f"{name} must be a string or a list of text parts", param=name)


def _text(item: dict, key: str, name: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise ApiError.invalid(f"{name}.{key} must be a non-empty string", param=f"{name}.{key}")
    return value


def _tools(tools: Any) -> list[dict]:
    """Responses' function tools `{type, name, description, parameters, strict}` as chat's."""
    out = []
    for name, tool in named_items(tools, "tools", "a list of function tools"):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError.invalid(f"{name} must be a function tool {{\"type\": \"function\", \"name\": ...}} (only "
                                   "function tools are supported)", param=name)
        refuse_unknown_keys(tool, {"type", "name", "description", "parameters", "strict"}, name)
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        refuse_unknown_keys(choice, {"type", "name"}, "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise ApiError.invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")


def _format(text: dict) -> dict | None:
    """`text.format` -> chat's `response_format`."""
    refuse_unknown_keys(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError.invalid("text.verbosity is not supported by this server (only 'medium')", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError.invalid("text.format.type must be 'text', 'json_object' or 'json_schema'",
                               param="text.format.type")
    if fmt["type"] != "json_schema":
        refuse_unknown_keys(fmt, {"type"}, "text.format")
        return {"type": fmt["type"]}
    refuse_unknown_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError.invalid("text.format.schema must be a JSON Schema object", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _metadata(body: dict) -> None:
    """`metadata`: up to 16 string pairs, returned with the response."""
    metadata = get_value(body, "metadata", dict, {})
    if len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ApiError.invalid("metadata must be an object of at most 16 string values", param="metadata")


class ResponsesShaper:
    """The chat answer of a Responses request as a Response object, or as the Responses
    server-sent events (each named by its `type`, numbered by `sequence_number`)."""

    named_events = True  # `event: <type>` lines, as OpenAI sends them
    end_of_stream = b""  # no `[DONE]`: response.completed ends the stream

    def __init__(self, request: MappedRequest, model: str, body: dict, tool_call_parser: str) -> None:
        self.chat = ResponseShaper(request, model, tool_call_parser)
        self.id = "resp_" + request.request_id
        self.body = body
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict] = []  # the output items, the last one open while streaming
        self._open: dict | None = None
        self._sequence = 0
        self._finish_reason: str | None = None

    # ---- whole responses ----

    def response(self, chunks: Iterable[pb.GenerationChunk]) -> dict:
        choice = self.chat.response(chunks)["choices"][0]
        message = choice["message"]
        if message.get("content"):
            self.output.append(self._message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            self.output.append(self._call_item(call["id"], call["function"]["name"],
                                               call["function"]["arguments"], "completed"))
        self._finish_reason = choice["finish_reason"]
        return self._response(self._status())

    # ---- streams ----

    def opening(self) -> Iterator[dict]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))

    def events(self, chunk: pb.GenerationChunk) -> Iterator[dict]:
        for event in self.chat.events(chunk):
            choice = event["choices"][0]
            delta = choice.get("delta", {})
            if delta.get("content"):
                yield from self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    yield from self._close()
                    yield from self._open_item(self._call_item(call["id"], call["function"]["name"], "",
                                                               "in_progress"))
                arguments = call.get("function", {}).get("arguments")
                if arguments:
                    self._open["arguments"] += arguments
                    yield self._event("response.function_call_arguments.delta", **self._at(), delta=arguments)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]

    def closing(self) -> Iterator[dict]:
        yield from self._close()
        # response.completed even when max_output_tokens cut the answer (its status says so): the
        # clients' stream helpers wait for that event to end every stream.
        yield self._event("response.completed", response=self._response(self._status()))

    def failure(self, error: ApiError) -> dict:
        """The in-band event of a stream that failed after it started."""
        inner = error.body()["error"]
        return self._event("error", code=inner["code"], message=inner["message"], param=inner["param"])

    def _text_delta(self, text: str) -> Iterator[dict]:
        if self._open is None or self._open["type"] != "message":
            yield from self._close()
            yield from self._open_item(self._message_item("", "in_progress"))
            yield self._event("response.content_part.added", **self._at(), content_index=0,
                              part=copy.deepcopy(self._open["content"][0]))  # the open part keeps growing
        self._open["content"][0]["text"] += text
        yield self._event("response.output_text.delta", **self._at(), content_index=0, delta=text, logprobs=[])

    def _open_item(self, item: dict) -> Iterator[dict]:
        self._open = item
        self.output.append(item)
        yield self._event("response.output_item.added", output_index=len(self.output) - 1,
                          item=copy.deepcopy(item))  # the open item keeps growing

    def _close(self) -> Iterator[dict]:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            yield self._event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield self._event("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield self._event("response.function_call_arguments.done", **at, name=item["name"],
                              arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=at["output_index"], item=item)

    def _at(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    # ---- the pieces ----

    @staticmethod
    def _message_item(text: str, status: str) -> dict:
        return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": status, "call_id": call_id,
                "name": name, "arguments": arguments}

    def _status(self) -> str:
        return "incomplete" if self._finish_reason == "length" else "completed"

    def _response(self, status: str) -> dict:
        body = self.body
        done = status != "in_progress"
        text_format = (body.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model, "output": self.output if done else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": body.get("temperature", 1.0), "text": {"format": text_format},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"),
            "metadata": body.get("metadata") or {}, "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict:
        """The prompt tokens not read from the prefix cache were computed and written to it."""
        usage = self.chat.choices.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": usage["prompt_tokens"] - cached},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}
