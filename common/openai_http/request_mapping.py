"""An OpenAI completions / chat completions request body -> a duet.v1.GenerateRequest.

Fields that would change the answer but that duet cannot honour (echo, logprobs, penalties,
tools, ...) are refused with a 400 naming the field rather than silently ignored.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from typing import Any

from common.openai_http.api_errors import ApiError
from common.sampling import MAX_N
from protos.duet.v1 import duet_pb2 as pb

# OpenAI's defaults where they differ from SamplingParams' own.
DEFAULT_TEMPERATURE = 1.0
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Chat without a limit generates until EOS or the model's context is full (the node stops there).
CHAT_DEFAULT_MAX_TOKENS = 2**31 - 1

_NEUTRAL_ZERO = (None, 0)
_UNSUPPORTED_COMPLETION = {"echo": (None, False), "logprobs": (None,), "suffix": (None, ""),
                           "logit_bias": (None, {}), "presence_penalty": _NEUTRAL_ZERO,
                           "frequency_penalty": _NEUTRAL_ZERO}
_UNSUPPORTED_CHAT = {"logprobs": (None, False), "top_logprobs": (None,), "logit_bias": (None, {}),
                     "presence_penalty": _NEUTRAL_ZERO, "frequency_penalty": _NEUTRAL_ZERO,
                     "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                     "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
                     "prediction": (None,)}


class Endpoint(Enum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True)
class MappedRequest:
    """What the server needs to call Generate and to shape its answer."""

    endpoint: Endpoint
    generate: pb.GenerateRequest
    n: int
    stream: bool
    include_usage: bool

    @property
    def request_id(self) -> str:
        return self.generate.request_id


def map_request(endpoint: Endpoint, body: Any, served_model: str) -> MappedRequest:
    """Validate `body` (parsed JSON) and translate it; ApiError says what is wrong."""
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    model = _get(body, "model", str)
    if model is not None and model != served_model:
        raise ApiError(HTTPStatus.NOT_FOUND, f"the model '{model}' does not exist; this server serves "
                       f"'{served_model}'", param="model", code="model_not_found")
    chat = endpoint is Endpoint.CHAT
    _refuse_unsupported(body, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)
    n = _get(body, "n", int, 1, check=lambda v: 1 <= v <= MAX_N, need=f"an integer from 1 to {MAX_N}")
    if not chat:
        best_of = _get(body, "best_of", int)
        if best_of is not None and best_of != n:
            raise ApiError.invalid("best_of is not supported (only best_of == n)", param="best_of")
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise ApiError.invalid("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False, name="stream_options.include_usage")
    request = pb.GenerateRequest(request_id=uuid.uuid4().hex)
    if chat:
        request.messages.extend(_chat_messages(body))
    else:
        _set_prompt(request, body)
    try:
        request.sampling.CopyFrom(_sampling(body, chat, n))
    except (ValueError, TypeError) as exc:  # a number outside the protobuf field's range
        raise ApiError.invalid(f"a sampling value is out of range: {exc}") from None
    return MappedRequest(endpoint, request, n, stream, include_usage)


def _sampling(body: dict, chat: bool, n: int) -> pb.SamplingParams:
    max_tokens = _get(body, "max_tokens", int)
    if chat:
        max_tokens = _get(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", float, DEFAULT_TEMPERATURE),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),  # a vLLM extension standard benchmarks send
        ignore_eos=_get(body, "ignore_eos", bool, False),  # likewise
        stop=_stop_strings(body),
    )
    seed = _get(body, "seed", int)
    if seed is not None:
        params.seed = seed
    if n != 1:
        params.n = n
    return params


def _set_prompt(request: pb.GenerateRequest, body: dict) -> None:
    """`prompt` is a string, a list of token ids, or a list holding exactly one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ApiError.invalid(f"only one prompt per request is supported (got {len(prompt)}); "
                                   "send one request per prompt", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        request.token_ids.extend(prompt)
    else:
        raise ApiError.invalid("prompt must be a non-empty string or a non-empty list of token ids",
                               param="prompt")


def _chat_messages(body: dict) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError.invalid(f"{name} must be an object with role and content", param=name)
        role = _get(message, "role", str, name=f"{name}.role")
        if not role:
            raise ApiError.invalid(f"{name}.role is missing", param=f"{name}.role")
        out.append(pb.ChatMessage(role=role, content=_message_text(message.get("content"), f"{name}.content")))
    return out


def _message_text(content: Any, name: str) -> str:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError.invalid(f"{name} must be a string or a list of text parts (other part types are not "
                           "supported)", param=name)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError.invalid("stop must be a string or a list of strings", param="stop")


def _refuse_unsupported(body: dict, unsupported: dict[str, tuple]) -> None:
    for name, neutral in unsupported.items():
        if name in body and body[name] not in neutral:
            raise ApiError.invalid(f"'{name}' is not supported by this server", param=name)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(body: dict, key: str, kind: type, default: Any = None, *, name: str | None = None,
         check: Callable[[Any], bool] | None = None, need: str | None = None) -> Any:
    """`body[key]` if present and not null, checked to be of `kind` (ints count as numbers,
    booleans never as numbers), else `default`."""
    value = body.get(key)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is int:
        ok = _is_int(value)
    else:
        ok = isinstance(value, kind)
    if not ok or (check is not None and not check(value)):
        name = name or key
        raise ApiError.invalid(f"'{name}' must be {need or _TYPE_NAMES[kind]}", param=name)
    return value
