"""Both daemons as real processes on loopback: the hand-off gives exactly the single-node output."""
from __future__ import annotations

import time

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node
from harness.helpers import Started, drain, greedy, no_leak, random_ids, three_calls
from harness.reference import FP32, engine_greedy, hf_greedy

TRANSPORTS = ["nixl", "tcp"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def daemons(request, tmp_path_factory):
    """Per transport, started side by side: the decode node and prefill node of `pair`, and a
    prefill node with another page size (`other_page_size`)."""
    tmp = tmp_path_factory.mktemp(f"pair_{request.param}")
    transport = (*FP32, "--transport", request.param)
    with Started(tmp) as s:
        pn = s.spawn("prefill_node", *transport, "--max-batch-tokens", "512")
        dn = s.spawn("decode_node", *transport, "--prefill", pn.address, "--min-remote-prefill-tokens", "1")
        other = s.spawn("prefill_node", *transport, "--page-size", "8")
        s.wait()
        yield dn, pn, other


@pytest.fixture(scope="module")
def pair(daemons):
    dn, pn, _ = daemons
    return dn, pn


@pytest.fixture(scope="module")
def other_page_size(daemons):
    """A prefill node of the pair's transport whose pages hold 8 positions (the decode node's 16)."""
    return daemons[2]


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 100])
def test_three_call_flow_equals_single_node(pair, model, length):
    dn, pn = pair
    prompt = random_ids(length, 1000 + length)
    tokens, r, sent, last = three_calls(dn, pn, f"len{length}", prompt)
    assert tokens == engine_greedy(model, prompt, 8)
    if length > 1:
        assert sent.tokens_sent == length - 1 and r.prefix_matched_length == 0
    assert last.usage.prompt_tokens == length


def test_long_prompt_equals_transformers(pair, model, hf_model):
    dn, pn = pair
    prompt = random_ids(2100, 7)
    tokens, _, sent, _ = three_calls(dn, pn, "long", prompt, max_tokens=6)
    assert sent.tokens_sent == 2099 and sent.bytes_sent > 0
    assert tokens == hf_greedy(hf_model, prompt, 6)


def test_one_call_generate_with_prefill_node(pair, model, tokenizer, hf_model):
    dn, pn = pair
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}]))
    before = pn.metrics()["duet_prefill_computed_tokens_total"]
    tokens, last = drain(dn.stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=greedy(16))))
    assert tokens == hf_greedy(hf_model, ids, 16)
    assert pn.metrics()["duet_prefill_computed_tokens_total"] > before  # the prefill node did the work


def test_decode_side_prefix_hit_sends_only_the_rest(pair, model):
    dn, pn = pair
    base = random_ids(70, 8)
    three_calls(dn, pn, "hit-a", base)
    prompt = base[:64] + random_ids(30, 9)
    tokens, r, sent, last = three_calls(dn, pn, "hit-b", prompt)
    assert r.prefix_matched_length == 64 and sent.tokens_sent == len(prompt) - 1 - 64
    assert tokens == engine_greedy(model, prompt, 8) and last.usage.cached_tokens == 64


def test_prefill_side_prefix_cache_is_not_recomputed(pair, model):
    dn, pn = pair
    prompt = random_ids(90, 10)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="warm", token_ids=prompt))
    first = pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id="warm", token_ids=prompt, kv_window_begin=0, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce))
    dn.stub.Abort(pb.AbortRequest(request_id="warm"))  # the decode node keeps nothing of it
    tokens, r, sent, _ = three_calls(dn, pn, "again", prompt)
    # The first RemoteSend left five full pages and a tail page of 9 positions: all but the last
    # of the 89 positions the prefill node computes are cached.
    assert first.tokens_computed == 89 and sent.tokens_computed == 1 and r.prefix_matched_length == 0
    assert tokens == engine_greedy(model, prompt, 8)


def test_bad_requests_leave_both_nodes_clean(pair):
    dn, pn = pair
    prompt = random_ids(40, 11)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="bad", token_ids=prompt))
    good = dict(request_id="bad", token_ids=prompt, kv_window_begin=0, kv_window_end=39,
                kv_append_metadata=list(r.kv_append_metadata), decode_address=dn.address,
                transfer_nonce=r.transfer_nonce)
    cases = [
        (dict(kv_append_metadata=[1, 0, 38]), grpc.StatusCode.INVALID_ARGUMENT, "cover 38 tokens but 39"),
        (dict(kv_append_metadata=[2, 0, 39]), grpc.StatusCode.INVALID_ARGUMENT, "2n+1"),
        (dict(kv_append_metadata=[1, 10**9, 39]), grpc.StatusCode.INVALID_ARGUMENT, "pool"),
        (dict(kv_window_end=40), grpc.StatusCode.INVALID_ARGUMENT, "kv_window_end"),
        (dict(kv_window_begin=39), grpc.StatusCode.INVALID_ARGUMENT, "kv_window_begin"),
        (dict(decode_address="127.0.0.1:1"), grpc.StatusCode.UNAVAILABLE, "unreachable"),
        (dict(transfer_nonce=r.transfer_nonce ^ 1), grpc.StatusCode.PERMISSION_DENIED, "nonce"),
        (dict(request_id="unknown"), grpc.StatusCode.NOT_FOUND, "unknown"),
    ]
    wrong = []
    for change, code, fragment in cases:
        with pytest.raises(grpc.RpcError) as info:
            pn.stub.RemoteSend(pb.RemoteSendRequest(**{**good, **change}))
        if info.value.code() != code or fragment not in info.value.details():
            wrong.append((change, info.value.code(), info.value.details()))
    assert not wrong
    # The reservation survived the garbage and still works.
    pn.stub.RemoteSend(pb.RemoteSendRequest(**good))
    drain(dn.stub.StartGeneration(pb.StartGenerationRequest(request_id="bad", kv_window_begin=39,
                                                                sampling=greedy(2))))
    deadline = time.monotonic() + 10
    while not (no_leak(dn) and no_leak(pn)):
        assert time.monotonic() < deadline, (dn.metrics(), pn.metrics())
        time.sleep(0.1)


def test_wrong_fingerprint_is_failed_precondition(pair, other_page_size):
    dn, _ = pair
    other = other_page_size
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="fp", token_ids=random_ids(20, 12)))
    with pytest.raises(grpc.RpcError) as info:
        other.stub.RemoteSend(pb.RemoteSendRequest(
            request_id="fp", token_ids=random_ids(20, 12), kv_window_begin=0, kv_window_end=19,
            kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "page_size: decode node has 16, prefill node has 8" in info.value.details()
    assert no_leak(other)
    dn.stub.Abort(pb.AbortRequest(request_id="fp"))


@pytest.fixture(scope="module")
def small_pair(pair, tmp_path_factory):
    """A decode node with a 48-page pool, small enough to fragment with a few calls, and the
    prefill node of `pair` (of the same transport) handing prompts to it."""
    _, pn = pair
    transport = pn.proc.args[pn.proc.args.index("--transport") + 1]
    tmp = tmp_path_factory.mktemp(f"small_pair_{transport}")
    with decode_node(tmp, *FP32, "--transport", transport, "--kv-pages", "48", "--prefill", pn.address) as dn:
        yield dn, pn


def test_churned_pool_transfer_gives_exact_tokens_and_metrics(small_pair, model):
    """Reservations interleaved with aborted ones leave 2-page holes: a 12-page reservation then
    spans several segments, and the hand-off into them still gives the single-node tokens."""
    dn, pn = small_pair
    held = []
    for i in range(22):
        dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=f"hold{i}", token_ids=random_ids(33, 300 + i)))
        held.append(f"hold{i}")
    for rid in held[::2]:
        dn.stub.Abort(pb.AbortRequest(request_id=rid))
    prompt = random_ids(193, 12)
    before_d, before_p = dn.metrics(), pn.metrics()
    tokens, r, sent, _ = three_calls(dn, pn, "churned", prompt)
    segments = r.kv_append_metadata[0]
    assert segments >= 2 and tokens == engine_greedy(model, prompt, 8)
    after_d, after_p = dn.metrics(), pn.metrics()
    for before, after in ((before_d, after_d), (before_p, after_p)):
        assert after["duet_kv_transfer_bytes_total"] - before.get("duet_kv_transfer_bytes_total", 0) == sent.bytes_sent
        assert after["duet_kv_transfer_segments_sum"] - before.get("duet_kv_transfer_segments_sum", 0) == segments
        assert after["duet_kv_transfer_seconds_count"] - before.get("duet_kv_transfer_seconds_count", 0) == 1
    for rid in held[1::2]:
        dn.stub.Abort(pb.AbortRequest(request_id=rid))
    assert no_leak(dn)
