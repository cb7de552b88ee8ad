"""The APIs coding agents speak, driven by their own clients against a real prefill + decode pair
and a router: OpenAI's Responses (the `openai` package; the Agents SDK's Responses model is in
tests/http/test_openai_tools.py) and Anthropic's Messages (the `anthropic` package). Greedy text
equals the chat completion of the same conversation; tools round-trip; an agent's next turn is
read from the prefix cache."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest

from harness.openai_front import API_KEYS, MESSAGES

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
ASK = "What is the weather in Paris?"
MAX_TOKENS = 12


@pytest.fixture(params=["node", "router"])
def front(request, keyed):
    """The decode node's HTTP front, or the router's."""
    return keyed[2] if request.param == "node" else keyed[3]


def _anthropic(front, key: str = API_KEYS[0]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=front.url, api_key=key, max_retries=0, timeout=120)


def _post(url: str, body: dict, key: str = API_KEYS[0]) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "x-api-key": key}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), headers), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_greedy_text_equals_the_chat_completion(front, model_name):
    """The same conversation through chat completions, Responses and Messages, whole and streamed."""
    system, user = MESSAGES[0]["content"], MESSAGES[1]["content"]
    chat = front.client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                temperature=0).choices[0].message.content
    assert chat
    plain = dict(model=model_name, instructions=system, input=user, max_output_tokens=MAX_TOKENS, temperature=0)
    assert front.client.responses.create(**plain).output_text == chat
    with front.client.responses.stream(**plain) as events:
        assert events.get_final_response().output_text == chat
    client = _anthropic(front)
    message = dict(model=model_name, system=system, messages=[{"role": "user", "content": user}],
                   max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    answer = client.messages.create(**message)
    assert answer.content[0].text == chat and answer.stop_reason == "max_tokens"
    with client.messages.stream(**message) as events:
        assert events.get_final_text() == chat


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_sequence_that_ended_a_message_is_named(keyed, model_name, stream):
    node = keyed[2]
    chat = node.client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                               temperature=0).choices[0].message.content
    word = chat.split()[2]
    request = dict(model=model_name, system=MESSAGES[0]["content"], max_tokens=MAX_TOKENS, stop_sequences=[word],
                   messages=[{"role": "user", "content": MESSAGES[1]["content"]}], extra_body={"temperature": 0})
    if stream:
        with _anthropic(node).messages.stream(**request) as events:
            answer = events.get_final_message()
    else:
        answer = _anthropic(node).messages.create(**request)
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", word)
    assert answer.content[0].text == chat[:chat.index(word)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_function_tool_round_trip(keyed, model_name, stream):
    """A forced function_call, its function_call_output sent back with it, a text answer (tool_choice none)."""
    via_router = keyed[3]
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city now.",
              "parameters": WEATHER, "strict": True}]

    def create(**request):
        if not stream:
            return via_router.client.responses.create(**request)
        with via_router.client.responses.stream(**request) as events:
            return events.get_final_response()

    request = dict(model=model_name, tools=tools, temperature=0, max_output_tokens=80)
    first = create(input=ASK, tool_choice="required", **request)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}]
    final = create(input=history, tool_choice="none", **request)
    assert final.output_text and not [item for item in final.output if item.type == "function_call"]


def test_responses_text_format_json_schema(keyed, model_name):
    node = keyed[2]
    answer = node.client.responses.create(model=model_name, input="Give me a city as JSON.", temperature=0,
                                          max_output_tokens=60, text={"format": {"type": "json_schema",
                                                                                 "name": "city", "schema": WEATHER}})
    jsonschema.validate(json.loads(answer.output_text), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_tool_use_round_trip(keyed, model_name, stream):
    """A forced tool_use (tool_choice any), its tool_result sent back, a text answer (tool_choice none)."""
    client = _anthropic(keyed[3])

    def create(**request) -> anthropic.types.Message:
        if not stream:
            return client.messages.create(**request)
        with client.messages.stream(**request) as events:
            return events.get_final_message()

    request = dict(model=model_name, max_tokens=80, extra_body={"temperature": 0},
                   tools=[{"name": "get_weather", "description": "The weather in a city now.", "input_schema": WEATHER}])
    first = create(messages=[{"role": "user", "content": ASK}], tool_choice={"type": "any"}, **request)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    final = create(messages=[{"role": "user", "content": ASK}, {"role": "assistant", "content": first.content},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                           "content": "sunny, 18 degrees"}]}],
                   tool_choice={"type": "none"}, **request)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]


def test_token_counts_are_the_prompts_a_generation_reads(keyed, model_name):
    node = keyed[2]
    counted = node.client.responses.input_tokens.count(model=model_name, input=ASK, instructions="Be brief.")
    used = node.client.responses.create(model=model_name, input=ASK, instructions="Be brief.", max_output_tokens=1)
    assert counted.input_tokens == used.usage.input_tokens > 10
    client = _anthropic(node)
    counted = client.messages.count_tokens(model=model_name, system="Be brief.",
                                           messages=[{"role": "user", "content": ASK}])
    used = client.messages.create(model=model_name, system="Be brief.", messages=[{"role": "user", "content": ASK}],
                                  max_tokens=1).usage
    assert counted.input_tokens == used.input_tokens + used.cache_read_input_tokens == counted.input_tokens


def test_an_agents_next_turn_is_read_from_the_prefix_cache(keyed, model_name):
    """Claude Code's system prompt opens with a billing line that differs every request: dropped
    (the default), the second turn finds the whole first turn in the prefix cache."""
    client = _anthropic(keyed[2])
    rules = " ".join(f"Rule {i}: keep every answer short, exact and polite." for i in range(30))
    conversation = [{"role": "user", "content": "List three colours."}]

    def turn(billing: str) -> anthropic.types.Message:
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{billing}; cch={billing};"},
                  {"type": "text", "text": f"You are a coding agent. {rules}", "cache_control": {"type": "ephemeral"}}]
        return client.messages.create(model=model_name, system=system, messages=conversation, max_tokens=8,
                                      extra_body={"temperature": 0})

    first = turn("a1")
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    conversation += [{"role": "assistant", "content": first.content[0].text},
                     {"role": "user", "content": "And three more."}]
    second = turn("b2")
    assert first_prompt > 300 and second.usage.cache_read_input_tokens > 0.8 * first_prompt


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]}, 400, "tool_use_id"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, None),
    ("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, 400,
     "input[0].call_id"),
    ("/v1/responses", {"input": "word " * 9000}, 400, None),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("/v1/messages/count_tokens", {"messages": []}, 400, "messages"),
    ("/v1/responses/input_tokens", {"input": [{"type": "reasoning"}]}, 400, "input[0].type"),
])
def test_bad_input_gets_the_apis_own_error_and_the_node_serves_on(keyed, model_name, path, body, status, param):
    node = keyed[2]
    code, answer = _post(node.url + path, body)
    assert code == status
    if path.startswith("/v1/messages"):  # Anthropic's shape, which names no field: the message does
        assert answer["type"] == "error" and answer["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert param is None or param.split(".")[-1] in answer["error"]["message"]
    else:
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    assert node.client.responses.create(model=model_name, input="Hi", max_output_tokens=2).usage.output_tokens == 2


def test_x_api_key_and_per_endpoint_metrics(keyed, model_name):
    node = keyed[2]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _anthropic(node, "wrong-key").messages.create(model=model_name, max_tokens=1,
                                                      messages=[{"role": "user", "content": "x"}])
    assert refused.value.body["error"]["type"] == "authentication_error"

    def counted() -> dict[str, float]:
        with urllib.request.urlopen(urllib.request.Request(
                node.url + "/metrics", headers={"x-api-key": API_KEYS[1]}), timeout=30) as r:
            lines = r.read().decode().splitlines()
        return {line.split('"')[1]: float(line.split()[-1]) for line in lines
                if line.startswith("duet_http_requests_total{")}

    before = counted()
    _anthropic(node, API_KEYS[1]).messages.create(model=model_name, max_tokens=1,
                                                  messages=[{"role": "user", "content": "x"}])
    after = counted()
    assert after["/v1/messages"] == before["/v1/messages"] + 1
    assert after["/v1/responses"] == before["/v1/responses"]
