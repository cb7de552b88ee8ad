"""The OpenAI-compatible HTTP front (`--openai-port`) on a real prefill + decode pair and on the
router, driven by the real `openai` client package and by raw HTTP."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from concurrent import futures

import aiohttp
import grpc
import openai
import pytest

from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import CHAT_DEFAULT_MAX_TOKENS, Endpoint, map_request
from common.openai_http.api_processes import OpenAIFront
from common.openai_http.api_server import ApiServerSettings
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import free_port, router
from harness.daemon_fixtures import part_of
from harness.helpers import Started, greedy
from harness.reference import hf_greedy
from harness.openai_front import DAEMON_FLAGS, MESSAGES, Front

PROMPT = "In the quiet village at the edge of the forest, the old clockmaker spent his evenings"
FRESH_PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"
MAX_TOKENS = 10
SMALL_MAX_REQUESTS = 4


@pytest.fixture(scope="module")
def daemons(tmp_path_factory, certs):  # noqa: F811
    """`pair`, `tls_node` and `small_node`, started side by side."""
    tmp = tmp_path_factory.mktemp("openai_http")
    port, tls_port, small_port = free_port(), free_port(), free_port()
    with Started(tmp) as s:
        pn = s.spawn("prefill_node", *DAEMON_FLAGS)
        dn = s.spawn("decode_node", *DAEMON_FLAGS, "--prefill", pn.address, "--min-remote-prefill-tokens", "8",
                     "--openai-port", str(port))
        tls_dn = s.spawn("decode_node", *DAEMON_FLAGS, "--openai-port", str(tls_port), tls=certs["node"])
        small = s.spawn("decode_node", *DAEMON_FLAGS, "--openai-port", str(small_port), "--max-requests",
                        str(SMALL_MAX_REQUESTS), "--api-server-count", "2")
        s.wait()
        yield (dn, pn, Front(port)), (tls_dn, tls_port), (small, Front(small_port))


pair = part_of("daemons", 0, "A prefill node and a decode node handing prompts to it, the decode node serving HTTP.")
tls_node = part_of("daemons", 1, "A decode node serving gRPC and HTTPS with the node certificate of `certs`, and its "
                   "HTTP port.")
small_node = part_of("daemons", 2, f"A decode node holding at most {SMALL_MAX_REQUESTS} requests, its HTTP port served "
                     "by two API servers.")


def grpc_generate(stub, request: pb.GenerateRequest) -> tuple[str, pb.Usage]:
    """The node's own answer over gRPC: the text and the final usage."""
    chunks = list(stub.Generate(request, timeout=120))
    return "".join(c.text for c in chunks), chunks[-1].usage


GREEDY = greedy(MAX_TOKENS, ignore_eos=False)  # EOS may end it, as it may the OpenAI requests compared with it


def test_request_mapping():
    """Without a daemon: OpenAI fields land in the GenerateRequest, OpenAI's defaults apply."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
            "stop": "\n", "seed": 7, "n": 3, "top_p": 0.5, "stream": True, "stream_options": {"include_usage": True}}
    mapped = map_request(Endpoint.CHAT, body, "m")
    s = mapped.generate.sampling
    assert list(mapped.generate.messages) == [pb.ChatMessage(role="user", content="ab")]
    assert (list(s.stop), s.seed, s.n, s.top_p, s.temperature) == (["\n"], 7, 3, 0.5, 1.0)
    assert s.max_tokens == CHAT_DEFAULT_MAX_TOKENS and mapped.stream and mapped.include_usage
    mapped = map_request(Endpoint.COMPLETIONS, {"prompt": [[3, 4]], "max_tokens": 5, "temperature": 0}, "m")
    assert list(mapped.generate.token_ids) == [3, 4] and mapped.generate.sampling.max_tokens == 5
    assert not mapped.generate.sampling.HasField("n") and not mapped.stream


@pytest.mark.parametrize("endpoint, body, param", [
    (Endpoint.COMPLETIONS, {"prompt": ""}, "prompt"),
    (Endpoint.COMPLETIONS, {"prompt": [1, "x"]}, "prompt"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "no_such_field": 1}, "no_such_field"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}],
                     "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "temperature": True}, "temperature"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "n": 2_000_000_000}, "n"),  # refused before anything is sized by it
    (Endpoint.COMPLETIONS, {"prompt": "x", "stop": ["a", 1]}, "stop"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "seed": 2**70}, None),
    (Endpoint.CHAT, {"messages": []}, "messages"),
    (Endpoint.CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
])
def test_request_mapping_refusals(endpoint, body, param):
    with pytest.raises(ApiError) as refused:
        map_request(endpoint, body, "m")
    assert refused.value.status == 400 and refused.value.param == param


def test_models_lists_the_served_model(pair, model_name):
    _, _, front = pair
    assert model_name == "SmolLM2-135M-Instruct"  # derived from SmolLM2-135M-Instruct.Q4_1.gguf
    assert [m.id for m in front.client.models.list().data] == [model_name]
    assert front.client.models.retrieve(model_name).id == model_name


def test_completion_equals_grpc_and_transformers(pair, model_name, hf_model, tokenizer):
    dn, pn, front = pair
    computed_before = pn.metrics()["duet_prefill_computed_tokens_total"]  # no test sent FRESH_PROMPT before
    r = front.client.completions.create(model=model_name, prompt=FRESH_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    prompt_ids = tokenizer.encode(FRESH_PROMPT)
    assert pn.metrics()["duet_prefill_computed_tokens_total"] > computed_before  # the pair handed it off
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tokenizer.decode(hf_greedy(hf_model, prompt_ids, MAX_TOKENS))
    text, usage = grpc_generate(dn.stub, pb.GenerateRequest(prompt=FRESH_PROMPT, sampling=GREEDY))
    assert r.choices[0].text == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    assert r.usage.total_tokens == len(prompt_ids) + MAX_TOKENS
    assert usage.prompt_tokens == len(prompt_ids)
    # The same prompt as token ids gives the same text; it is cached by now.
    again = front.client.completions.create(model=model_name, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert again.choices[0].text == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_completion_concatenates_and_ends_with_usage(pair, model_name, tokenizer):
    dn, _, front = pair
    text, usage = grpc_generate(dn.stub, pb.GenerateRequest(prompt=PROMPT, sampling=GREEDY))
    events = list(front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True, stream_options={"include_usage": True}))
    *content, last = events
    assert len(content) > 1 and all(e.usage is None for e in content)
    assert "".join(e.choices[0].text for e in content) == text
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (usage.prompt_tokens, MAX_TOKENS)
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the prompt's full pages, served just before


def test_chat_completion_plain_and_streamed(pair, model_name, hf_model, tokenizer):
    dn, _, front = pair
    r = front.client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                             temperature=0)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    message = r.choices[0].message
    assert message.role == "assistant"
    assert message.content == tokenizer.decode(hf_greedy(hf_model, prompt_ids, MAX_TOKENS))
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES], sampling=GREEDY)
    assert message.content == grpc_generate(dn.stub, request)[0]
    assert r.usage.prompt_tokens == len(prompt_ids) and r.choices[0].finish_reason == "length"

    events = list(front.client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                       max_completion_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert events[0].object == "chat.completion.chunk" and events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == message.content
    assert [e.choices[0].finish_reason for e in events][-1] == "length"


def test_bad_requests_are_400_and_the_daemon_keeps_serving(pair, model_name, tokenizer):
    dn, _, front = pair
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        front.client.completions.create(model=model_name, prompt=PROMPT, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="not a usable grammar"):  # the node compiles it
        front.client.chat.completions.create(model=model_name, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):  # the node's INVALID_ARGUMENT
        front.client.completions.create(model=model_name, prompt=[1, 10**7], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        front.client.completions.create(model=model_name, prompt=["a", "b"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):  # refused by the node, streamed or not
        front.client.completions.create(model=model_name, prompt=PROMPT, top_p=0, stream=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        front.client.completions.create(model="no-such-model", prompt=PROMPT)

    malformed = urllib.request.Request(f"{front.url}/v1/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(malformed, timeout=30)
    assert failed.value.code == 400
    error = json.loads(failed.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not valid JSON" in error["message"]

    r = front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == grpc_generate(dn.stub, pb.GenerateRequest(prompt=PROMPT, sampling=GREEDY))[0]


def test_raw_server_sent_events(pair, model_name):
    """What curl sees: `data: {json}` events separated by blank lines, then `data: [DONE]`."""
    dn, _, front = pair
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    request = urllib.request.Request(f"{front.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        raw = response.read().decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = raw.split("\n\n")[:-2]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[len("data: "):]) for e in events]
    assert {p["object"] for p in payloads} == {"text_completion"}
    text = "".join(p["choices"][0]["text"] for p in payloads)
    assert text == grpc_generate(dn.stub, pb.GenerateRequest(prompt=PROMPT, sampling=GREEDY))[0]


def test_client_disconnect_cancels_the_request(pair, model_name):
    dn, _, front = pair
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(front.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # the stream has begun
    assert dn.stub.GetLoad(pb.GetLoadRequest(), timeout=10).running_requests == 1
    conn.close()
    deadline = time.monotonic() + 10  # 1500 tokens would take minutes; the cancel must end it long before
    while dn.stub.GetLoad(pb.GetLoadRequest(), timeout=10).running_requests:
        assert time.monotonic() < deadline, "the request kept running after its client disconnected"
        time.sleep(0.1)
    load = dn.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.kv_pages_free + load.kv_pages_cached == load.kv_pages_total  # no page is held any more


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
def test_the_front_listens_on_ipv6_hosts(host, tmp_path):
    """The daemon's side binds the port; its API server answers /v1/models (which needs no node)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    settings = ApiServerSettings(listen_fd=-1, grpc_target="", model_names=("m",), api_keys=(),
                                 tool_call_parser="hermes", tokenizer_path=None, max_model_len=None, metrics_url=None,
                                 created=0)
    front = OpenAIFront(host, 0, 1, settings, server, registry=None)
    server.start()
    front.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = json.load(urllib.request.urlopen(f"http://[::1]:{front.port}/v1/models", timeout=10))
                break
            except urllib.error.URLError:  # the API server is still starting (the port is bound, not yet served)
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["m"]
    finally:
        front.stop()
        server.stop(0)
        front.join(10)


def test_chunked_request_bodies_are_read(pair, model_name):
    _, _, front = pair
    conn = http.client.HTTPConnection(front.url.removeprefix("http://"), timeout=30)
    body = json.dumps({"model": model_name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    try:
        conn.request("POST", "/v1/completions", body=iter([body[:10], body[10:]]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2
    finally:
        conn.close()


def test_router_serves_the_same_api(pair, tmp_path, model_name):
    dn, pn, direct_front = pair
    port = free_port()
    with router(tmp_path, "--decode", dn.address, "--prefill", pn.address, "--poll-seconds", "0.2",
                "--openai-port", str(port)):
        client = Front(port).client
        assert [m.id for m in client.models.list().data] == [model_name]
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == grpc_generate(dn.stub, pb.GenerateRequest(prompt=PROMPT, sampling=GREEDY))[0]
        streamed = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES], sampling=GREEDY)
        assert "".join(e.choices[0].delta.content or "" for e in streamed) == grpc_generate(dn.stub, request)[0]
        # Prompt logprobs: the router sends such a request to the decode node's Generate (computed there).
        scored = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
        direct = direct_front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True,
                                                        logprobs=0)
        assert scored.choices[0].text == PROMPT and scored.choices[0].logprobs.token_logprobs[0] is None
        assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
            direct.choices[0].logprobs.token_logprobs[1:], abs=1e-4)



def test_https_with_mutual_tls(certs, tls_node, model_name):  # noqa: F811
    """With --tls-cert/--tls-ca the front is HTTPS and, like the gRPC port, wants a client
    certificate signed by the CA; the loopback Generate call presents the node's own."""
    dn, port = tls_node

    def client(tls) -> openai.OpenAI:
        context = ssl.create_default_context(cafile=str(certs["ca_only"].ca))
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
        return Front(port, "https", context).client

    streamed = client(certs["client"]).completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=True)
    text = grpc_generate(dn.stub, pb.GenerateRequest(prompt=PROMPT, sampling=GREEDY))[0]
    assert "".join(e.choices[0].text for e in streamed) == text
    for refused in (client(certs["ca_only"]), client(certs["rogue"]), Front(port).client):
        with pytest.raises(openai.APIConnectionError):
            refused.models.list()


def test_parallel_samples_are_separate_choices(pair, model_name):
    """n=2 greedy: both choices are the n=1 greedy text, streamed or not."""
    _, _, front = pair
    one = front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    two = front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [(c.index, c.text) for c in two.choices] == [(0, one.choices[0].text), (1, one.choices[0].text)]
    assert two.usage.completion_tokens == 2 * MAX_TOKENS
    texts = ["", ""]
    for event in front.client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0, n=2, stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == [one.choices[0].text] * 2


def test_a_burst_gets_answers_or_429s_never_resets(small_node, model_name):
    """Eight times more streamed requests at once than the node holds: every one is answered,
    served with the tokens it gets alone or refused 429 with Retry-After and an OpenAI error
    body; no connection is reset, no page is left held, and the node serves right after."""
    dn, front = small_node
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    url = f"{front.url}/v1/chat/completions"

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None, str]:
        async with session.post(url, json=body) as response:
            return response.status, response.headers.get("Retry-After"), (await response.read()).decode()

    async def burst(n: int) -> list[tuple[int, str | None, str]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session) for _ in range(n)))

    def text(raw: str) -> str:
        events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])

    alone = asyncio.run(burst(1))[0]
    assert alone[0] == 200 and alone[2].endswith("data: [DONE]\n\n")
    answers = asyncio.run(burst(8 * SMALL_MAX_REQUESTS))  # a reset would raise here
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert len(served) >= SMALL_MAX_REQUESTS and refused
    assert all(text(raw) == text(alone[2]) for _, _, raw in served)
    for status, retry_after, raw in refused:
        assert status == 429 and retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    assert asyncio.run(burst(1))[0][0] == 200
    load = dn.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.kv_pages_free + load.kv_pages_cached == load.kv_pages_total
