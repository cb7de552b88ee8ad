"""The decode node daemon through real gRPC: contract, statuses, leases, no leaked pages."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node
from harness.daemon_fixtures import part_of
from harness.helpers import greedy, random_ids, started_side_by_side, status_of, wire_slots
from harness.reference import FP32, hf_greedy

PAGE = 16


def run(stream) -> tuple[list[int], str, pb.GenerationChunk]:
    tokens, text, last = [], "", None
    for chunk in stream:
        tokens += chunk.token_ids
        text += chunk.text
        last = chunk
    return tokens, text, last


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """`node` and `small_node`, started side by side."""
    with started_side_by_side(tmp_path_factory.mktemp("dn"), ("decode_node", FP32),
                              ("decode_node", (*FP32, "--kv-pages", "64", "--lease-seconds", "1"))) as both:
        yield both


node = part_of("nodes", 0, "A float32 decode node, its other settings the defaults.")
small_node = part_of("nodes", 1, "64 pages of 16 tokens and a 1 s lease.")


def pages_back_to_baseline(d) -> bool:
    m = d.metrics()
    return m["duet_kv_pages_free"] + m["duet_kv_pages_cached"] == m["duet_kv_pages_total"] and \
        m["duet_kv_pages_reserved"] == 0


def test_health_and_reflection(node):
    stub = reflection_pb2_grpc.ServerReflectionStub(node.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"duet.v1.DecodeNode", "grpc.health.v1.Health"} <= names


def test_single_node_generate_matches_transformers(node, tokenizer, hf_model):
    for question in ("What is 2+2?", "Name three colours."):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
        tokens, text, last = run(node.stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=greedy(24))))
        assert tokens == hf_greedy(hf_model, ids, 24)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert last.finish_reason == "length" and last.usage.prompt_tokens == len(ids)
        assert last.usage.completion_tokens == 24


def test_generate_from_chat_messages_and_text(node, tokenizer):
    messages = [pb.ChatMessage(role="user", content="What is the capital of France?")]
    _, text, last = run(node.stub.Generate(pb.GenerateRequest(messages=messages,
                                                              sampling=pb.SamplingParams(max_tokens=30))))
    assert "Paris" in text and last.finish_reason == "stop"
    _, _, last = run(node.stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=greedy(3))))
    assert last.usage.prompt_tokens == len(tokenizer.encode("Hello"))


def test_prepare_receive_metadata_describes_the_reserved_window(node):
    prompt = random_ids(45, 1)
    r = node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="meta", token_ids=prompt))
    assert r.prompt_length == 45 and r.kv_window_end == 44 and r.prefix_matched_length == 0
    md = list(r.kv_append_metadata)
    assert len(md) == 2 * md[0] + 1 and len(wire_slots(md)) == 44
    assert r.lease_deadline_unix > time.time() and r.transfer_nonce > 0
    node.stub.Abort(pb.AbortRequest(request_id="meta"))


@pytest.mark.parametrize("end, expected", [(0, 0), (5, 5), (-3, 7)])
def test_kv_window_end_resolution(node, end, expected):
    rid = f"end{end}"
    r = node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=random_ids(10, 2), kv_window_end=end))
    assert r.kv_window_end == expected and len(wire_slots(r.kv_append_metadata)) == expected
    if expected == 0:
        assert list(r.kv_append_metadata) == [0]
    node.stub.Abort(pb.AbortRequest(request_id=rid))


def test_full_prefix_hit_three_call_flow_equals_generate(node):
    prompt = random_ids(40, 3)
    want, _, _ = run(node.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(8))))
    # The finished request's two full pages and its tail page (positions 32..46) are cached: all
    # but the last prompt token match, and a window ending at 32 needs nothing sent.
    r = node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="hit", token_ids=prompt, kv_window_end=32))
    assert r.prefix_matched_length == 39 and list(r.kv_append_metadata) == [0]
    got, _, last = run(node.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="hit", kv_window_begin=32, sampling=greedy(8))))
    assert got == want and last.usage.cached_tokens == 39


def test_prefix_reuse_shrinks_the_reserved_range(node):
    prompt = random_ids(50, 4)
    run(node.stub.Generate(pb.GenerateRequest(token_ids=prompt[:40], sampling=greedy(1))))
    r = node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="reuse", token_ids=prompt))
    assert r.prefix_matched_length == 40  # two full pages and the 8 positions of the tail page
    assert len(wire_slots(r.kv_append_metadata)) == 49 - 40
    node.stub.Abort(pb.AbortRequest(request_id="reuse"))


def test_concurrent_reservations_never_share_a_slot(node):
    def reserve(i):
        return node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=f"c{i}", token_ids=random_ids(70, 100 + i)))

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(reserve, range(24)))
    seen: set[int] = set()
    for r in replies:
        slots = set(wire_slots(r.kv_append_metadata))
        assert len(slots) == 69 and not slots & seen
        seen |= slots
    for i in range(24):
        node.stub.Abort(pb.AbortRequest(request_id=f"c{i}"))


def test_fragmented_pool_gives_multi_segment_metadata(small_node):
    stub = small_node.stub
    slots = {}
    for name in "abcd":  # 15 pages each: 60 of 64 used
        r = stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=name, token_ids=random_ids(241, ord(name))))
        slots[name] = set(wire_slots(r.kv_append_metadata))
    for name in "bd":  # free runs of 15 and 19 pages: no run holds 20
        stub.Abort(pb.AbortRequest(request_id=name))
    r = stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="e", token_ids=random_ids(321, 9)))
    md = list(r.kv_append_metadata)
    assert md[0] >= 2, md
    e = set(wire_slots(md))
    assert len(e) == 320 and not e & slots["a"] and not e & slots["c"]
    for name in "ace":
        stub.Abort(pb.AbortRequest(request_id=name))
    assert pages_back_to_baseline(small_node)


def test_lease_expiry_returns_pages(small_node):
    before = small_node.metrics()
    small_node.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="lease", token_ids=random_ids(100, 5)))
    assert small_node.metrics()["duet_kv_pages_reserved"] == 7
    wait_for(lambda: small_node.metrics()["duet_kv_pages_reserved"] == 0, timeout=5)
    after = small_node.metrics()
    assert after["duet_kv_pages_free"] == before["duet_kv_pages_free"]
    assert after["duet_lease_expiries_total"] == before.get("duet_lease_expiries_total", 0) + 1
    assert status_of(lambda: small_node.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="lease", kv_window_begin=99, sampling=greedy(1)))) == grpc.StatusCode.NOT_FOUND


def test_pool_exhaustion_is_resource_exhausted_fast(small_node):
    started = time.monotonic()
    code = status_of(lambda: small_node.stub.PrepareReceive(
        pb.PrepareReceiveRequest(request_id="huge", token_ids=random_ids(2000, 6))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 2
    code = status_of(lambda: small_node.stub.Generate(pb.GenerateRequest(token_ids=random_ids(2000, 6), sampling=greedy(2))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pages_back_to_baseline(small_node)


@pytest.mark.parametrize("request_kwargs, fragment", [
    (dict(request_id="", token_ids=[1, 2]), "request_id"),
    (dict(request_id="x", token_ids=[]), "empty"),
    (dict(request_id="x", token_ids=[5, 49152]), "outside the vocabulary"),
    (dict(request_id="x", token_ids=[5, 6, 7], kv_window_end=3), "kv_window_end"),
    (dict(request_id="x", token_ids=[5, 6, 7], kv_window_end=-4), "kv_window_end"),
    (dict(request_id="x", token_ids=[5] * 8192), "context"),
])
def test_prepare_receive_invalid_arguments(node, request_kwargs, fragment):
    with pytest.raises(grpc.RpcError) as info:
        node.stub.PrepareReceive(pb.PrepareReceiveRequest(**request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()


def test_duplicate_unknown_and_premature_calls(node):
    stub = node.stub
    r = stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="dup", token_ids=random_ids(20, 7)))
    assert status_of(lambda: stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="dup", token_ids=[1, 2]))) \
        == grpc.StatusCode.ALREADY_EXISTS
    start = pb.StartGenerationRequest(request_id="dup", kv_window_begin=19, sampling=greedy(1))
    assert status_of(lambda: stub.StartGeneration(start)) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(lambda: stub.StartGeneration(pb.StartGenerationRequest(
        request_id="dup", kv_window_begin=3, sampling=greedy(1)))) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: stub.CompleteTransfer(pb.CompleteTransferRequest(
        request_id="dup", transfer_nonce=r.transfer_nonce ^ 1))) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(lambda: stub.StartGeneration(pb.StartGenerationRequest(
        request_id="nope", kv_window_begin=1, sampling=greedy(1)))) == grpc.StatusCode.NOT_FOUND
    assert status_of(lambda: stub.Abort(pb.AbortRequest(request_id="nope"))) == grpc.StatusCode.NOT_FOUND
    stub.Abort(pb.AbortRequest(request_id="dup"))
    assert status_of(lambda: stub.Abort(pb.AbortRequest(request_id="dup"))) == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("request_kwargs, fragment", [
    (dict(), "exactly one"),
    (dict(prompt="hi", token_ids=[1]), "exactly one"),
    (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=-1)), "max_tokens"),
    (dict(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (dict(messages=[pb.ChatMessage(role="user", content="x")], sampling=pb.SamplingParams(stop=[""])), "stop"),
])
def test_generate_invalid_arguments(node, request_kwargs, fragment):
    with pytest.raises(grpc.RpcError) as info:
        list(node.stub.Generate(pb.GenerateRequest(**request_kwargs)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()


def test_cancelled_stream_and_abort_free_pages(node):
    stream = node.stub.Generate(pb.GenerateRequest(request_id="cancel", token_ids=random_ids(30, 8),
                                                   sampling=greedy(100_000)))
    next(stream)
    stream.cancel()
    stream2 = node.stub.Generate(pb.GenerateRequest(request_id="abort", token_ids=random_ids(30, 9),
                                                    sampling=greedy(100_000)))
    next(stream2)
    node.stub.Abort(pb.AbortRequest(request_id="abort"))
    _, _, last = run(stream2)
    assert last.finish_reason == "abort"
    wait_for(lambda: pages_back_to_baseline(node))


def test_sigterm_drains_and_exits_zero(tmp_path):
    with decode_node(tmp_path, *FP32) as d:
        stream = d.stub.Generate(pb.GenerateRequest(token_ids=random_ids(10, 10), sampling=greedy(20)))
        next(stream)
        d.proc.send_signal(signal.SIGTERM)
        tokens, _, last = run(stream)  # the in-flight stream still completes
        assert last.finish_reason == "length"
        assert d.proc.wait(30) == 0
