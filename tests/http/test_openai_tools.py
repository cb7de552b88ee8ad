"""Tool calling and API keys on the OpenAI front: the hermes parser and the request checks
without a daemon; the `openai` client's tool loop, forced calls over the reference prompts, an
OpenAI Agents SDK agent and the 401s against a real prefill + decode pair and a router."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import agents
import jsonschema
import openai
import pytest

from common.model.tokenizer import Tokenizer
from common.openai_http.api_errors import ApiError
from common.openai_http.api_keys import ENV_VAR, ApiKeys
from common.openai_http.request_mapping import Endpoint, map_request
from common.openai_http.tool_output import ToolAnswer, parse_hermes
from common.openai_http.tools import ToolMode, tool_plan
from common.serving.prompts import prompt_token_ids
from decode_node.config import parse_args as decode_node_args
from protos.duet.v1 import duet_pb2 as pb
from router.__main__ import parse_args as router_args
from harness.reference import JSON_PROMPTS, REFERENCE_PROMPTS
from harness.openai_front import API_KEYS as KEYS

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add_person", "description": "Store a person.",
                                           "parameters": PERSON}}]
SCHEMAS = {"get_weather": WEATHER, "add_person": PERSON}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def plan(**body):
    return tool_plan({"tools": TOOLS, **body})[0]


def hermes(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARIS = hermes("get_weather", {"city": "Paris", "unit": "celsius"})


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny in Paris.", None, None),  # a plain answer: left alone
    ("Use <tool_call> blocks to call.", None, None),
    (PARIS, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me look.\n" + PARIS + "\n" + hermes("add_person", {"name": "Ann", "age": 3}), "Let me look.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add_person", {"name": "Ann", "age": 3})]),
    (PARIS[:-len("</tool_call>")], None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),  # unclosed last
    (hermes("get_time", {}), None, None),  # not one of the tools
    (hermes("get_weather", {"city": "Paris"}), None, None),  # a strict tool's arguments must validate
    (hermes("add_person", {"name": "Ann"}), None, [("add_person", {"name": "Ann"})]),  # not strict: as written
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>", None, None),  # not JSON
    (PARIS + " and more words", None, None),
])
def test_hermes_parser_reads_calls_and_leaves_plain_answers_alone(text, content, calls):
    parsed = parse_hermes(text, plan())
    if calls is None:
        assert parsed is None
        return
    assert parsed[0] == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed[1]] == calls
    assert all(c.id.startswith("call_") for c in parsed[1])
    assert len(parse_hermes(text, plan(parallel_tool_calls=False))[1]) == 1


@pytest.mark.parametrize("text", ["Sunny, 18 degrees.", "  \n" + PARIS, "Here: <tool_call> is how I call.",
                                  "Looking it up.\n" + PARIS])
def test_streamed_auto_answer_assembles_to_the_whole_answer(text):
    """Fed a character at a time, the deltas add up to what the non-streamed message holds."""
    whole, reason = ToolAnswer(plan()).message(text, "stop")
    answer = ToolAnswer(plan())
    deltas = [d for ch in text for d in answer.feed(ch)]
    last, streamed_reason = answer.finish("stop")
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed_reason == reason
    if "tool_calls" in whole:
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
        assert content.strip() == (whole["content"] or "")
    else:
        assert content == text and not calls and reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools[0].function.examples"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "refusal": "no"}]}, "messages[0].refusal"),
])
def test_tool_fields_are_checked_by_name(body, param):
    with pytest.raises(ApiError) as refused:
        map_request(Endpoint.CHAT, {"messages": ASK, **body}, "m")
    assert refused.value.status == 400 and refused.value.param == param


def test_forced_calls_map_to_a_grammar_of_the_tools_schemas():
    named = map_request(Endpoint.CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "add_person"}}}, "m")
    assert json.loads(named.generate.sampling.guided.json_schema) == PERSON and named.tools.mode is ToolMode.NAMED
    required = map_request(Endpoint.CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                           "parallel_tool_calls": False}, "m")
    schema = json.loads(required.generate.sampling.guided.json_schema)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    jsonschema.validate([{"name": "add_person", "arguments": {"name": "Ann", "age": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"name": "Ann", "age": 3}}], schema)
    assert [t.name for t in required.generate.tools] == ["get_weather", "add_person"]
    auto = map_request(Endpoint.CHAT, {"messages": ASK, "tools": TOOLS}, "m")
    assert auto.tools.mode is ToolMode.AUTO and not auto.generate.sampling.HasField("guided")
    none = map_request(Endpoint.CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, "m")
    assert none.tools is None and not none.generate.tools


CONVERSATION = pb.GenerateRequest(
    messages=[pb.ChatMessage(role="user", content="Weather in Paris?"),
              pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather",
                                                                       arguments='{"city": "Paris"}')]),
              pb.ChatMessage(role="tool", tool_call_id="c1", content="18 degrees")],
    tools=[pb.FunctionTool(name="get_weather", description="The weather now.", parameters=json.dumps(WEATHER))])


def test_tools_and_tool_messages_render_without_tool_support_in_the_template(tokenizer):
    """The embedded model's template knows no tools: the documented system message and Hermes blocks."""
    assert not tokenizer.takes_tools
    text = tokenizer.decode(prompt_token_ids(CONVERSATION, tokenizer))
    assert text.startswith("<|im_start|>system\nYou can call the following functions")
    assert '"name": "get_weather", "description": "The weather now."' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n18 degrees<|im_end|>" in text


def test_a_template_that_takes_tools_renders_them_itself(tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}{{ c.function.arguments.city }}{% endfor %}"
                "{{ m.tool_call_id or '' }};{% endfor %}")
    own = Tokenizer(tokenizer._backend, tokenizer.eos_token_id, chat_template=template)
    assert own.takes_tools
    assert own.decode(prompt_token_ids(CONVERSATION, own)) == \
        "[get_weather]user:Weather in Paris?;assistant:get_weatherParis;tool:18 degreesc1;"


def test_api_keys_compare_in_constant_time_and_stay_secret():
    keys = ApiKeys.from_flags(["k1"], environ={ENV_VAR: "k2"})
    assert keys.admits("Bearer k1") and keys.admits("bearer k2") and not keys.admits("Bearer k3")
    assert not keys.admits(None) and not keys.admits("k1") and not keys.admits("Basic k1")
    assert "k1" not in repr(keys) and ApiKeys().admits(None) and not ApiKeys().required
    config = decode_node_args(["--openai-port", "0", "--api-key", "k1", "--api-key", "k3"])
    assert config.api_key == ("k1", "k3") and "k1" not in repr(config)
    for parse in (decode_node_args, router_args):  # a key guards the HTTP API only
        with pytest.raises(SystemExit):
            parse(["--api-key", "k1"])


def _status(url: str, key: str | None, body: dict | None = None) -> tuple[int, dict, str | None]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as r:
            return r.status, json.loads(r.read()), None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("WWW-Authenticate")


def test_requests_without_the_key_get_401_on_node_and_router(keyed, model_name):
    dn, rt, node, via_router = keyed
    chat = {"model": model_name, "messages": ASK, "max_tokens": 2}
    for front, keys in ((node, KEYS), (via_router, KEYS[:1])):
        for key in (None, "wrong-key"):
            for path, body in (("/v1/models", None), ("/v1/chat/completions", chat)):
                status, answer, challenge = _status(front.url + path, key, body)
                assert (status, answer["error"]["code"], challenge) == (401, "invalid_api_key", "Bearer")
                assert answer["error"]["type"] == "invalid_request_error"
        for key in keys:
            assert _status(front.url + "/v1/chat/completions", key, chat)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{via_router.url}/v1", api_key=KEYS[1], max_retries=0).models.list()  # one key there
    for daemon in (dn, rt):
        log = daemon.log_path.read_text()
        assert "api_key_required" in log and not any(k in log for k in KEYS)


def _assembled(client: openai.OpenAI, stream: bool, **request):
    """The answer, as the client assembles a stream of deltas (chat.completions.stream) or not."""
    if not stream:
        return client.chat.completions.create(**request)
    with client.chat.completions.stream(**request) as events:
        return events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_clients_tool_loop(keyed, model_name, stream):
    """Call with tool_choice="required", run the tool, send its result as a tool message, get the
    final answer: unchanged client code, through the router, streamed and not."""
    _, _, _, via_router = keyed
    client, messages = via_router.client, list(ASK)
    request = {"model": model_name, "tools": TOOLS[:1], "temperature": 0, "max_tokens": 100}
    answer = _assembled(client, stream, messages=messages, tool_choice="required", **request).choices[0]
    assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
    call = answer.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    messages += [answer.message,  # as the client returned it
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = _assembled(client, stream, messages=messages, **request).choices[0]
    assert final.finish_reason == "stop" and final.message.content and not final.message.tool_calls


def test_forced_calls_validate_over_the_reference_prompts(keyed, model_name):
    """Sampled (temperature 1), every forced call's arguments parse and validate: a named
    function's and tool_choice="required"'s, for each reference prompt and request for JSON."""
    _, _, node, _ = keyed
    choices = ["required", {"type": "function", "function": {"name": "add_person"}}]

    def ask(case: tuple[int, str, object]):
        seed, prompt, choice = case
        return node.client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=choice,
            temperature=1.0, seed=seed, max_tokens=160).choices[0]

    cases = [(i, p, c) for i, p in enumerate(REFERENCE_PROMPTS + JSON_PROMPTS) for c in choices]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for (_, _, choice), answer in zip(cases, answers):
        assert answer.finish_reason == "tool_calls", answer
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in answer.message.tool_calls] == ["add_person"]


@pytest.mark.parametrize("sdk_model", [agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel])
def test_an_openai_agents_sdk_agent_completes_a_one_tool_task(keyed, model_name, sdk_model):
    """The OpenAI Agents SDK's Runner against the decode node, on its Chat Completions model and
    on its default, the Responses model: the first turn must call the tool (the SDK then resets
    tool_choice), the next answers."""
    _, _, node, _ = keyed
    agents.set_tracing_disabled(True)
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return json.dumps({"temperature": 18, "sky": "sunny"})

    client = openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key=KEYS[1], max_retries=0, timeout=120)
    agent = agents.Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                         model=sdk_model(model=model_name, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=100))
    result = agents.Runner.run_sync(agent, ASK[0]["content"], max_turns=3)
    assert asked and asked[0]
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_a_grpc_client_forces_a_call_with_guided_json_schema(keyed):
    """docs/openai.md "Over gRPC": the tools go in the prompt, the arguments' schema in guided."""
    dn, _, _, _ = keyed
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])],
        tools=[pb.FunctionTool(name="get_weather", description="The weather in a city now.",
                               parameters=json.dumps(WEATHER))],
        sampling=pb.SamplingParams(max_tokens=100, guided=pb.GuidedDecoding(json_schema=json.dumps(WEATHER))))
    chunks = list(dn.stub.Generate(request, timeout=120))
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), WEATHER)
