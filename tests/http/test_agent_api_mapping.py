"""The Responses and Messages APIs without a daemon: every field of the `openai` and `anthropic`
packages' own request types honoured or refused by name, the bodies' translation onto the chat
path, and the shapers' answers and event sequences, which the clients' own models then parse."""
from __future__ import annotations

import json
import typing

import anthropic.types as anthropic_types
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.types import responses as openai_responses
from pydantic import TypeAdapter

from common.openai_http import messages_api, responses_api
from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import HONOURED, Endpoint, map_request
from common.openai_http.messages_api import MessagesShaper
from common.openai_http.responses_api import ResponsesShaper
from protos.duet.v1 import duet_pb2 as pb

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_EVENT = TypeAdapter(openai_responses.ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(anthropic_types.RawMessageStreamEvent)
NOT_NEUTRAL = "surely-not-neutral"
WRONG_TYPE = [{}]


def _fields(*classes) -> set[str]:
    return {name for cls in classes for name in typing.get_type_hints(cls)}


RESPONSES_SCHEMA = _fields(openai_responses.response_create_params.ResponseCreateParamsStreaming,
                           openai_responses.response_create_params.ResponseCreateParamsNonStreaming)
MESSAGES_SCHEMA = _fields(anthropic_types.message_create_params.MessageCreateParamsStreaming,
                          anthropic_types.message_create_params.MessageCreateParamsNonStreaming)
MINIMAL = {"responses": {"input": "x"}, "messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}}
API = {"responses": (responses_api.chat_body, responses_api.FIELDS, RESPONSES_SCHEMA),
       "messages": (messages_api.chat_body, messages_api.FIELDS, MESSAGES_SCHEMA)}


def _map(api: str, body: dict):
    """The chat request `body` means, mapped as the server maps it."""
    return map_request(Endpoint.CHAT, API[api][0](body), "m")


@pytest.mark.parametrize("api", list(API))
def test_every_schema_field_has_a_treatment(api):
    _, fields, schema = API[api]
    assert len(schema) > 15 and schema - set(fields) == set()


@pytest.mark.parametrize("api, name", [(api, name) for api, (_, _, schema) in API.items() for name in sorted(schema)])
def test_each_field_is_read_or_refused_by_name(api, name):
    """A honoured field of the wrong type, or a refused one asking for something, is a 400 naming it."""
    treatment = API[api][1][name]
    refused_field = isinstance(treatment, tuple)
    with pytest.raises(ApiError) as refused:
        _map(api, {**MINIMAL[api], name: NOT_NEUTRAL if refused_field else WRONG_TYPE})
    assert refused.value.status == 400 and refused.value.param.startswith(name)
    for accepted in treatment if refused_field else ([] if treatment is HONOURED else ["an id"]):
        _map(api, {**MINIMAL[api], name: accepted})


def test_responses_input_items_become_the_chat_conversation():
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 degrees"},
        {"type": "message", "role": "developer", "content": "Answer in one line."}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}}
    with pytest.raises(ApiError, match="response_format cannot be combined"):  # chat's own rule, by the same path
        _map("responses", body)
    mapped = _map("responses", {**body, "tool_choice": "auto"})
    assert [(m.role, m.content, m.tool_call_id) for m in mapped.generate.messages] == [
        ("system", "Be brief.", ""), ("user", "Weather in Paris?", ""), ("assistant", "", ""),
        ("tool", "18 degrees", "c1"), ("system", "Answer in one line.", "")]
    assert [(c.id, c.name) for c in mapped.generate.messages[2].tool_calls] == [("c1", "get_weather")]
    assert mapped.generate.sampling.max_tokens == 7 and json.loads(mapped.generate.sampling.guided.json_schema) == WEATHER
    assert [t.name for t in mapped.generate.tools] == ["get_weather"] and "get_weather" in mapped.tools.strict


def test_messages_blocks_become_the_chat_conversation():
    body = {"max_tokens": 9, "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"},
                                        {"type": "text", "text": "You are a coding agent.",
                                         "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18"},
                                                      {"type": "text", "text": "And now?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["END"], "top_k": 3}
    mapped = _map("messages", body)
    assert [(m.role, m.content, m.tool_call_id) for m in mapped.generate.messages] == [
        ("system", "You are a coding agent.", ""), ("user", "Weather in Paris?", ""), ("assistant", "Looking.", ""),
        ("tool", "18", "t1"), ("user", "And now?", "")]
    assert json.loads(mapped.generate.messages[2].tool_calls[0].arguments) == {"city": "Paris"}
    p = mapped.generate.sampling
    assert (p.max_tokens, list(p.stop), p.top_k, mapped.tools.parallel) == (9, ["END"], 3, False)
    kept = map_request(Endpoint.CHAT, messages_api.chat_body(body, strip_billing_header=False), "m")
    assert kept.generate.messages[0].content.startswith("x-anthropic-billing-header:")


@pytest.mark.parametrize("api, body, param", [
    ("responses", {"input": []}, "input"),
    ("responses", {"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ("responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ("responses", {"input": "x", "store": True}, "store"),
    ("responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}]}, "messages[0].content[0].tool_use_id"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ("messages", {**MINIMAL["messages"], "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
    ("messages", {**MINIMAL["messages"], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ("messages", {**MINIMAL["messages"], "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ("messages", {**MINIMAL["messages"], "stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_bodies_are_400s_naming_the_field(api, body, param):
    with pytest.raises(ApiError) as refused:
        _map(api, body)
    assert refused.value.status == 400 and refused.value.param == param


def test_anthropic_errors_have_anthropics_shape():
    error = ApiError(429, "busy", retry_after=3)
    assert error.anthropic_body() == {"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    anthropic_types.ErrorResponse.model_validate(error.anthropic_body())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chunks(*texts: str, reason: str = "stop", stop_string: str = "") -> list[pb.GenerationChunk]:
    chunks = [pb.GenerationChunk(text=t) for t in texts]
    chunks[-1].finish_reason, chunks[-1].stop_string = reason, stop_string
    chunks[-1].usage.CopyFrom(pb.Usage(prompt_tokens=40, completion_tokens=len(texts), cached_tokens=32))
    return chunks


def _stream(shaper, chunks) -> list[dict]:
    events = list(shaper.opening())
    for chunk in chunks:
        events += shaper.events(chunk)
    return events + list(shaper.closing())


TOOL_REQUEST = {"input": "Weather in Paris?", "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}


@pytest.mark.parametrize("texts, reason", [(("Sunny ", "and ", "mild."), "stop"), (("Sun",), "length"),
                                           (("Let me look.\n", CALL[:20], CALL[20:]), "stop")])
def test_responses_streams_add_up_to_the_whole_response(texts, reason):
    body = {**TOOL_REQUEST, "stream": True}
    whole = ResponsesShaper(_map("responses", body), "m", body, "hermes").response(_chunks(*texts, reason=reason))
    events = _stream(ResponsesShaper(_map("responses", body), "m", body, "hermes"), _chunks(*texts, reason=reason))
    for event in events:  # each one parses as the event its type names
        assert OPENAI_EVENT.validate_python(event).type == event["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] + [events[-1]["type"]] == [
        "response.created", "response.in_progress", "response.completed"]
    final = openai_responses.Response.model_validate(events[-1]["response"])
    assert [(o["type"], o.get("name")) for o in whole["output"]] == [(o.type, getattr(o, "name", None))
                                                                      for o in final.output]
    assert final.status == ("incomplete" if reason == "length" else "completed")
    assert final.usage.input_tokens_details.cached_tokens == 32
    streamed_text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed_text == final.output_text  # text streamed before a call keeps its trailing newline:
    assert streamed_text.strip() == openai_responses.Response.model_validate(whole).output_text
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    calls = [o for o in final.output if o.type == "function_call"]
    assert (json.loads(arguments) if arguments else None) == (json.loads(calls[0].arguments) if calls else None)


@pytest.mark.parametrize("texts, reason, stop_string, stop_reason", [
    (("Sunny ", "and mild."), "stop", "", "end_turn"), (("Sunny ",), "stop", "END", "stop_sequence"),
    (("Sun",), "length", "", "max_tokens"), (("", CALL), "stop", "", "tool_use")])
def test_messages_streams_add_up_to_the_whole_message(texts, reason, stop_string, stop_reason):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "Weather in Paris?"}], "stop_sequences": ["END"],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}], "stream": True}
    whole = MessagesShaper(_map("messages", body), "m", "hermes").response(_chunks(*texts, reason=reason,
                                                                                   stop_string=stop_string))
    message = anthropic_types.Message.model_validate(whole)
    assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_string or None)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (8, 32)
    events = _stream(MessagesShaper(_map("messages", body), "m", "hermes"),
                     _chunks(*texts, reason=reason, stop_string=stop_string))
    assert [e["type"] for e in events[:2]] + [e["type"] for e in events[-2:]] == [
        "message_start", "ping", "message_delta", "message_stop"]
    snapshot, buffers = None, {}
    for event in events:  # as the anthropic package's stream helper assembles them
        if event["type"] != "ping":
            snapshot = accumulate_event(event=ANTHROPIC_EVENT.validate_python(event), current_snapshot=snapshot,
                                        json_bufs=buffers)
    assert _without_ids(snapshot) == _without_ids(message)


def _without_ids(message: anthropic_types.Message) -> dict:
    """The message but for its id and its calls' (new ones each time)."""
    dump = message.model_dump(exclude={"id"})
    for block in dump["content"]:
        block.pop("id", None)
    return dump
