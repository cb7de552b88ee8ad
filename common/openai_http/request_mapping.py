"""An OpenAI completions / chat completions request body -> a duet.v1.GenerateRequest.

Every field a request may carry is in `FIELDS`: it is honoured, or refused with a 400 naming it
unless it holds a value that asks for nothing (e.g. `presence_penalty: 0`); a field that is not
listed there is refused too, so no field is ever silently ignored.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from typing import Any

from common.engine.sampling_limits import MAX_N, MAX_TOP_LOGPROBS
from common.openai_http.api_errors import ApiError
from common.openai_http.chat_messages import chat_messages
from common.openai_http.tools import ToolPlan, tool_plan
from protos.duet.v1 import duet_pb2 as pb

# OpenAI's defaults where they differ from SamplingParams' own.
DEFAULT_TEMPERATURE = 1.0
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Chat without a limit generates until EOS or the model's context is full (the node stops there).
CHAT_DEFAULT_MAX_TOKENS = 2**31 - 1


class Endpoint(Enum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


HONOURED = None  # a FIELDS entry: the field is read and acted on
ZERO = (None, 0)
NOTHING = (None,)
ANY_TEXT = "any string"  # an identifier for the caller's records (no effect on the answer)
# Every field of each endpoint -> HONOURED, ANY_TEXT, or the values that ask for nothing (refused otherwise).
_COMMON_FIELDS: dict[str, Any] = {
    "model": HONOURED, "n": HONOURED, "stream": HONOURED, "stream_options": HONOURED, "max_tokens": HONOURED,
    "temperature": HONOURED, "top_p": HONOURED, "seed": HONOURED, "stop": HONOURED, "logprobs": HONOURED,
    "response_format": HONOURED, "user": ANY_TEXT,
    "top_k": HONOURED, "ignore_eos": HONOURED,  # vLLM extensions that standard benchmarks send
    "num_speculative_tokens": HONOURED,  # duet: draft tokens per step on a --speculative node
    "logit_bias": (None, {}), "presence_penalty": ZERO, "frequency_penalty": ZERO,
}
_COMPLETION_ONLY: dict[str, Any] = {"prompt": HONOURED, "echo": HONOURED, "best_of": HONOURED, "suffix": (None, "")}
_CHAT_ONLY: dict[str, Any] = {
    "messages": HONOURED, "max_completion_tokens": HONOURED, "top_logprobs": HONOURED,
    "safety_identifier": ANY_TEXT, "prompt_cache_key": ANY_TEXT,  # the prefix cache needs no hint
    "tools": HONOURED, "tool_choice": HONOURED, "parallel_tool_calls": HONOURED,
    "functions": (None, []), "function_call": (None, "none"), "audio": NOTHING, "modalities": (None, ["text"]),
    "prediction": NOTHING, "reasoning_effort": NOTHING, "verbosity": NOTHING, "web_search_options": NOTHING,
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "moderation": NOTHING, "prompt_cache_options": NOTHING, "prompt_cache_retention": NOTHING,
}
FIELDS: dict[Endpoint, dict[str, Any]] = {Endpoint.COMPLETIONS: {**_COMMON_FIELDS, **_COMPLETION_ONLY},
                                          Endpoint.CHAT: {**_COMMON_FIELDS, **_CHAT_ONLY}}


@dataclass(frozen=True)
class MappedRequest:
    """What the server needs to call Generate and to shape its answer."""

    endpoint: Endpoint
    generate: pb.GenerateRequest
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool = False  # the answer carries the generated tokens' logprobs
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, with logprobs)
    tools: ToolPlan | None = None  # chat with tools: how the answer's calls are generated and read

    @property
    def request_id(self) -> str:
        return self.generate.request_id


def map_request(endpoint: Endpoint, body: Any, served_models: str | tuple[str, ...]) -> MappedRequest:
    """Validate `body` (parsed JSON) and translate it; ApiError says what is wrong. The body's
    `model` must be one of `served_models` (its names and aliases)."""
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    served = (served_models,) if isinstance(served_models, str) else served_models
    model = get_value(body, "model", str)
    if model is not None and model not in served:
        raise ApiError(HTTPStatus.NOT_FOUND, f"the model '{model}' does not exist; this server serves "
                       f"{', '.join(repr(m) for m in served)}", param="model", code="model_not_found")
    chat = endpoint is Endpoint.CHAT
    refuse_unsupported(body, FIELDS[endpoint])
    n = get_value(body, "n", int, 1, check=lambda v: 1 <= v <= MAX_N, need=f"an integer from 1 to {MAX_N}")
    if not chat:
        best_of = get_value(body, "best_of", int)
        if best_of is not None and best_of != n:
            raise ApiError.invalid("best_of is not supported (only best_of == n)", param="best_of")
    stream = get_value(body, "stream", bool, False)
    stream_options = get_value(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise ApiError.invalid("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = get_value(stream_options or {}, "include_usage", bool, False, name="stream_options.include_usage")
    request = pb.GenerateRequest(request_id=uuid.uuid4().hex)
    plan = None
    if chat:
        request.messages.extend(chat_messages(body))
        plan, tools = tool_plan(body)
        request.tools.extend(tools)
    else:
        _set_prompt(request, body)
    try:
        request.sampling.CopyFrom(_sampling(body, chat, n))
    except (ValueError, TypeError) as exc:  # a number outside the protobuf field's range
        raise ApiError.invalid(f"a sampling value is out of range: {exc}") from None
    forced = plan.guided() if plan is not None else None
    if forced is not None:
        request.sampling.guided.CopyFrom(forced)
    echo = not chat and get_value(body, "echo", bool, False)
    if echo and (request.sampling.logprobs or request.token_ids):  # the prompt's tokens (and text) come from the node
        request.sampling.prompt_logprobs = request.sampling.top_logprobs
    return MappedRequest(endpoint, request, n, stream, include_usage, request.sampling.logprobs, echo, plan)


def _sampling(body: dict, chat: bool, n: int) -> pb.SamplingParams:
    nonnegative = {"check": lambda v: v >= 0, "need": "an integer >= 0"}
    max_tokens = get_value(body, "max_tokens", int, **nonnegative)
    if chat:
        max_tokens = get_value(body, "max_completion_tokens", int, max_tokens, **nonnegative)
    if max_tokens is None:
        max_tokens = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=get_value(body, "temperature", float, DEFAULT_TEMPERATURE),
        top_p=get_value(body, "top_p", float, 1.0),
        top_k=get_value(body, "top_k", int, 0),
        ignore_eos=get_value(body, "ignore_eos", bool, False),
        stop=_stop_strings(body),
    )
    seed = get_value(body, "seed", int)
    if seed is not None:
        params.seed = seed
    draft = get_value(body, "num_speculative_tokens", int, **nonnegative)
    if draft is not None:
        params.num_speculative_tokens = draft
    if n != 1:
        params.n = n
    _set_logprobs(params, body, chat)
    guided = _guided(body)
    if guided is not None:
        params.guided.CopyFrom(guided)
    return params


_TOP_RANGE = {"check": lambda v: 0 <= v <= MAX_TOP_LOGPROBS, "need": f"an integer from 0 to {MAX_TOP_LOGPROBS}"}


def _set_logprobs(params: pb.SamplingParams, body: dict, chat: bool) -> None:
    """Chat: `logprobs` (bool) and `top_logprobs` (int); completions: `logprobs` (int, how many
    most likely tokens per position)."""
    if chat:
        params.logprobs = get_value(body, "logprobs", bool, False)
        params.top_logprobs = get_value(body, "top_logprobs", int, 0, **_TOP_RANGE)
        if params.top_logprobs and not params.logprobs:
            raise ApiError.invalid("top_logprobs needs logprobs to be true", param="top_logprobs")
        return
    top = get_value(body, "logprobs", int, None, **_TOP_RANGE)
    if top is not None:
        params.logprobs = True
        params.top_logprobs = top


def _guided(body: dict) -> pb.GuidedDecoding | None:
    """`response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema"}}."""
    response_format = get_value(body, "response_format", dict)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.GuidedDecoding(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError.invalid("response_format.json_schema.schema must be a JSON Schema object",
                                   param="response_format.json_schema.schema")
        return pb.GuidedDecoding(json_schema=json.dumps(schema))
    raise ApiError.invalid("response_format.type must be 'text', 'json_object' or 'json_schema'",
                           param="response_format.type")


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
    elif isinstance(prompt, list) and prompt and all(is_int(t) and 0 <= t < 2**31 for t in prompt):
        request.token_ids.extend(prompt)
    else:
        raise ApiError.invalid("prompt must be a non-empty string or a non-empty list of token ids (integers "
                               "from 0)", param="prompt")


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError.invalid("stop must be a string or a list of strings", param="stop")


def refuse_unsupported(body: dict, fields: dict[str, Any]) -> None:
    for name, value in body.items():
        if name not in fields:
            raise ApiError.invalid(f"unknown field '{name}': this server does not support it", param=name)
        treatment = fields[name]
        if treatment is ANY_TEXT:
            get_value(body, name, str)
        elif treatment is not HONOURED and value not in treatment:
            raise ApiError.invalid(f"'{name}' is not supported by this server (only {_neutral(treatment)})",
                                   param=name)


def _neutral(values: tuple) -> str:
    return " or ".join("null" if v is None else json.dumps(v) for v in values)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object",
               list: "a list"}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_value(body: dict, key: str, kind: type, default: Any = None, *, name: str | None = None,
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
        ok = is_int(value)
    else:
        ok = isinstance(value, kind)
    if not ok or (check is not None and not check(value)):
        name = name or key
        raise ApiError.invalid(f"'{name}' must be {need or _TYPE_NAMES[kind]}", param=name)
    return value
