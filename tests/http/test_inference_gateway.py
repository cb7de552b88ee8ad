"""The contract with Kubernetes' inference gateway, played as its endpoint picker plays it: the
decode node's /health, /metrics scraped with prometheus_client's parser, render and tokenize, the
x-prefiller-host-port header, vLLM-format KV events over ZMQ from both daemons (subscribed with
pyzmq, decoded with msgpack in vLLM's field order, replayed), and a router that says SERVING only
once it has a healthy decode node."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import msgpack
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from common.kv.block_hashes import block_hashes
from common.model.checkpoint import load_checkpoint
from common.openai_http import served_model_name
from common.serving.kv_events_zmq import END_OF_REPLAY
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import free_port
from harness.helpers import Started, greedy
from harness.reference import FP32

FLAGS = (*FP32, "--transport", "tcp", "--threads", "1", "--kv-pages", "160")
PAGE = 16
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "List the planets of the solar system, nearest to the sun first, "
                                        "and say in one line what each one is best known for."}]


class Subscriber:
    """The picker's side of one node's KV events: every message on the topic, in order."""

    def __init__(self, context: zmq.Context, endpoint: str, replay_endpoint: str) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.bind(endpoint)  # as the picker does; the node's publisher connects to it
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.replay_endpoint = replay_endpoint
        self.context = context
        self.messages: list[tuple[bytes, int, list]] = []  # topic, sequence, [ts, events]
        self.payloads: dict[int, bytes] = {}

    def take(self, timeout: float = 0.5) -> None:
        while self.sub.poll(int(timeout * 1000)):
            topic, sequence, payload = self.sub.recv_multipart()
            assert len(sequence) == 8
            self.messages.append((topic, int.from_bytes(sequence, "big"), msgpack.unpackb(payload)))
            self.payloads[self.messages[-1][1]] = payload

    def wait_for(self, done, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"no such KV event; got {self.messages}"
            self.take(0.2)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, sequence, payload = dealer.recv_multipart()
            if sequence == END_OF_REPLAY:
                assert payload == b""
                dealer.close()
                return out
            out.append((int.from_bytes(sequence, "big"), payload))

    def stored(self) -> list[list]:
        return [e for _, _, (_, events) in self.messages for e in events if e[0] == "BlockStored"]


def check_vllm_format(messages: list[tuple[bytes, int, list]], topic: bytes) -> None:
    """What the picker's KV cache indexer assumes of a stream: the topic, sequence numbers that
    rise, `[timestamp, events]` payloads, every parent announced before its children, token_ids
    covering whole blocks."""
    announced: set[int] = set()
    last = -1
    for got_topic, sequence, payload in messages:
        assert got_topic == topic and sequence > last
        last = sequence
        ts, events = payload
        assert isinstance(ts, float) and abs(ts - time.time()) < 600
        for event in events:
            kind, *fields = event
            if kind == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = fields
                assert parent is None or parent in announced, f"parent {parent} was never announced"
                assert block_size == PAGE and len(token_ids) == len(hashes) * PAGE
                assert lora_id is None and medium == "CPU"
                announced.update(hashes)
            elif kind == "BlockRemoved":
                hashes, medium = fields
                assert medium == "CPU"
                announced.difference_update(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                announced.clear()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_path) -> Iterator[dict]:
    """A decode node with an HTTP port and two prefill nodes, every node publishing KV events."""
    tmp = tmp_path_factory.mktemp("gateway")
    ends = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("dn", "dn_replay", "pn", "pn_replay", "pn2")}
    http_port = free_port()
    context = zmq.Context()
    subs = {"dn": Subscriber(context, ends["dn"], ends["dn_replay"]),
            "pn": Subscriber(context, ends["pn"], ends["pn_replay"])}
    with Started(tmp) as s:
        pn = s.spawn("prefill_node", *FLAGS, "--kv-events-endpoint", ends["pn"],
                     "--kv-events-replay-endpoint", ends["pn_replay"])
        pn2 = s.spawn("prefill_node", *FLAGS, "--kv-events-endpoint", ends["pn2"])
        dn = s.spawn("decode_node", *FLAGS, "--prefill", pn.address, "--prefill", pn2.address,
                     "--openai-port", str(http_port), "--kv-events-endpoint", ends["dn"],
                     "--kv-events-replay-endpoint", ends["dn_replay"])
        s.wait()
        for sub in subs.values():
            sub.take(0.5)
        yield {"dn": dn, "pn": pn, "pn2": pn2, "url": f"http://127.0.0.1:{http_port}", "http_port": http_port,
               "subs": subs, "model": served_model_name(model_path)}
    for sub in subs.values():
        sub.sub.close()
    context.term()


def _http(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _json(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, object]:
    status, data = _http(url, body, headers)
    return status, json.loads(data)


def test_health_and_the_pickers_gauges(gateway) -> None:
    assert _json(gateway["url"] + "/health") == (200, {"status": "serving"})
    status, text = _http(gateway["url"] + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge", name
        (sample,) = families[name].samples
        assert sample.value >= 0
    assert 0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels == {"block_size": str(PAGE), "num_gpu_blocks": "160"} and info.value == 1
    assert "duet_kv_pages_total" in families  # one registry: duet's own metrics beside them


def test_render_and_tokenize_agree_with_what_the_node_runs(gateway, tokenizer, model_path) -> None:
    url, model = gateway["url"], gateway["model"]
    context_len = load_checkpoint(model_path).config.max_position_embeddings
    status, chat = _json(url + "/v1/chat/completions/render", {"model": model, "messages": MESSAGES})
    assert status == 200
    expected = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    assert chat == {"token_ids": expected}
    assert _json(url + "/tokenize", {"model": model, "messages": MESSAGES}) == (
        200, {"count": len(expected), "max_model_len": context_len, "tokens": expected, "token_strs": None})
    status, completion = _json(url + "/v1/completions/render", {"model": model, "prompt": "The sky is"})
    assert status == 200 and completion == [{"token_ids": tokenizer.encode("The sky is")}]
    assert _json(url + "/detokenize", {"tokens": expected})[1] == {"prompt": tokenizer.decode(expected)}
    # Bad input: the status and a message a person can act on, as for the OpenAI routes.
    status, error = _json(url + "/detokenize", {"tokens": ["a"]})
    assert status == 400 and "token ids" in error["error"]["message"]
    status, error = _json(url + "/v1/chat/completions/render", {"model": "other", "messages": MESSAGES})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error = _json(url + "/v1/completions/render", {"model": model})
    assert status == 400


def test_kv_events_in_vllms_format_from_both_daemons(gateway, tokenizer) -> None:
    url, model, subs = gateway["url"], gateway["model"], gateway["subs"]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    status, _ = _json(url + "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 4},
                      {"x-prefiller-host-port": gateway["pn"].address})  # the subscribed prefill node
    assert status == 200
    # What the picker computes from render's tokens: the full pages of the positions the hand-off
    # moves (all but the last, which the decode node computes as it starts decoding).
    blocks = block_hashes(prompt[:-1], PAGE)
    assert len(blocks) >= 2
    for name, daemon in (("dn", gateway["dn"]), ("pn", gateway["pn"])):
        sub = subs[name]
        sub.wait_for(lambda: blocks[-1] in {h for e in sub.stored() for h in e[1]})
        port = gateway["http_port"] if name == "dn" else daemon.port
        check_vllm_format(sub.messages, f"kv@127.0.0.1:{port}@{model}".encode())
        # The prompt's full pages, chained from the prompt's start, with their tokens.
        chain = [h for e in sub.stored() for h in e[1]]
        tokens = [t for e in sub.stored() for t in e[3]]
        first = chain.index(blocks[0])
        assert chain[first : first + len(blocks)] == blocks
        assert tokens[first * PAGE : (first + len(blocks)) * PAGE] == prompt[: len(blocks) * PAGE]
        # A subscriber that missed messages gets them again, byte for byte, then the end marker.
        oldest = sub.messages[0][1]
        replayed = sub.replay(oldest)
        assert replayed == [(seq, sub.payloads[seq]) for seq in sorted(sub.payloads) if seq >= oldest]


def test_the_named_prefill_node_does_the_hand_off(gateway) -> None:
    url, model, dn, pn2 = gateway["url"], gateway["model"], gateway["dn"], gateway["pn2"]
    story = " ".join(["Long ago, keepers lived in lighthouses on rocky coasts and tended the lamps all night."] * 3)
    used, ignored = _header_counts(dn)
    before = pn2.metrics().get("duet_prefill_computed_tokens_total", 0)
    status, _ = _json(url + "/v1/completions", {"model": model, "prompt": story, "max_tokens": 2},
                      {"x-prefiller-host-port": pn2.address})
    assert status == 200
    assert pn2.metrics()["duet_prefill_computed_tokens_total"] > before  # pn2 computed it
    status, _ = _json(url + "/v1/completions", {"model": model, "prompt": "Once more: " + story, "max_tokens": 2},
                      {"x-prefiller-host-port": "10.9.9.9:1"})
    assert status == 200  # a node it does not know of: ignored, and counted
    assert _header_counts(dn) == (used + 1, ignored + 1)


def _header_counts(dn) -> tuple[float, float]:
    """duet_prefiller_header_requests_total by outcome: (used, ignored)."""
    families = {f.name: f for f in text_string_to_metric_families(dn.metrics_text())}
    family = families.get("duet_prefiller_header_requests")
    counts = {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")} if family else {}
    return counts.get("used", 0.0), counts.get("ignored", 0.0)


def _health(channel: grpc.Channel) -> int:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN


def _wait_health(channel: grpc.Channel, status: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _health(channel) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.01)


def test_a_router_is_serving_only_with_a_healthy_decode_node(tmp_path) -> None:
    """Started before its decode node, the router says NOT_SERVING; a Generate sent the moment it
    says SERVING succeeds; it says NOT_SERVING again when its only decode node hangs, and SERVING
    with a Generate that succeeds when it is back, three times over."""
    dn_port = free_port()
    with Started(tmp_path) as s:
        r = s.spawn("router", "--decode", f"127.0.0.1:{dn_port}", "--poll-seconds", "0.2")
        _wait_health_known(r)
        assert _health(r.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        dn = s.spawn("decode_node", *FLAGS, port=dn_port)
        stub = duet_pb2_grpc.DecodeNodeStub(r.channel)
        for attempt in range(4):
            _wait_health(r.channel, health_pb2.HealthCheckResponse.SERVING)
            chunks = list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=greedy(2)), timeout=60))
            assert sum(len(c.token_ids) for c in chunks) == 2, attempt
            if attempt == 3:
                break
            os.kill(dn.proc.pid, signal.SIGSTOP)  # a hang: polls time out
            try:
                _wait_health(r.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
            finally:
                os.kill(dn.proc.pid, signal.SIGCONT)


def _wait_health_known(d) -> None:
    deadline = time.monotonic() + 60
    while _health(d.channel) == health_pb2.HealthCheckResponse.UNKNOWN:
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log_path.read_text()
        time.sleep(0.05)
