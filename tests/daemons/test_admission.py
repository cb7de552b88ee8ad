"""Admission on the decode node (decode_node/admission.py): `--admission reject` refuses what does
not fit at once; `--admission queue` makes it wait, first come first served, in a bounded queue,
until pages free up, its deadline passes or it is aborted, with nothing leaked. Cold prefix-cache
pages are evicted rather than refusing or queuing.

Policy tests run a real DecodeNode (real model, real engine) in this process; the end-to-end ones
a real decode node daemon with a 16-page pool."""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.engine.sampling import SamplingParams
from common.errors import Aborted, DeadlineExceeded, ResourceExhausted
from decode_node.config import DecodeNodeConfig
from decode_node.node import DecodeNode
from decode_node.request_table import Status
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node
from harness.helpers import greedy, random_ids
from harness.reference import FP32, hf_greedy

PAGE = 16
POOL = 16



def _queued(node) -> int:
    return node.requests.counts()[Status.QUEUED]


def _prompt_for(pages: int, seed: int) -> list[int]:
    """A prompt whose default window (all but its last token) fills exactly `pages` pages."""
    return random_ids(pages * PAGE + 1, seed)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---- the policy, on an in-process node ----

@contextmanager
def in_process_node(model, tokenizer, **settings):
    """A real DecodeNode in this process: 16 pages of 16 tokens, no watermark."""
    config = DecodeNodeConfig(port=0, transport="tcp", kv_pages=POOL, page_size=PAGE, admission_watermark=0.0,
                              **settings)
    node = DecodeNode(config, model, tokenizer)
    try:
        yield node
    finally:
        node.shutdown()


def refusals(node: DecodeNode, reason: str) -> float:
    return node.metrics.registry.get_sample_value("duet_admission_refusals_total", {"reason": reason}) or 0.0


def assert_refused_at_once(node: DecodeNode, request_id: str, prompt: list[int], match: str, reason: str) -> None:
    """PrepareReceive raises RESOURCE_EXHAUSTED without waiting, the first refusal counted for `reason`."""
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match=match):
        node.prepare_receive(request_id, prompt, None)
    assert time.monotonic() - started < 0.5 and refusals(node, reason) == 1


def abort_and_assert_pool_whole(node: DecodeNode, *request_ids: str) -> None:
    """Abort the requests still held: then no request is left and every page is free or cached."""
    for request_id in request_ids:
        node.abort(request_id)
    with node.engine.lock:
        assert not node.requests.counts()
        assert node.engine.allocator.num_free + node.engine.prefix_cache.num_cached_pages == POOL


def test_reject_mode_refuses_what_does_not_fit_at_once(model, tokenizer):
    with in_process_node(model, tokenizer) as node:
        node.prepare_receive("hold", _prompt_for(12, 1), None)
        assert_refused_at_once(node, "big", _prompt_for(5, 2), "needs 5 pages, 4 are available", "pages")
        node.prepare_receive("fits", _prompt_for(4, 3), None)  # exactly the rest of the pool
        assert node.load().queued_requests == 0
        abort_and_assert_pool_whole(node, "hold", "fits")


def test_queue_is_fifo_a_big_head_is_not_starved_by_small_requests(model, tokenizer):
    with in_process_node(model, tokenizer, admission="queue") as node, ThreadPoolExecutor(2) as pool:
        node.prepare_receive("hold", _prompt_for(12, 1), None)
        big = pool.submit(node.prepare_receive, "big", _prompt_for(8, 2), None)
        wait_for(lambda: _queued(node) == 1)
        small = pool.submit(node.prepare_receive, "small", _prompt_for(2, 3), None)  # would fit in the 4 free
        wait_for(lambda: _queued(node) == 2)
        time.sleep(0.3)  # several wake-ups of both waiters
        assert not big.done() and not small.done() and node.requests.get("small").status is Status.QUEUED
        node.abort("hold")
        assert big.result(timeout=5).kv_window_end == 8 * PAGE
        assert small.result(timeout=5).kv_window_end == 2 * PAGE
        assert node.metrics.registry.get_sample_value("duet_admission_wait_seconds_count") == 2
        abort_and_assert_pool_whole(node, "big", "small")


def test_running_and_total_token_caps_queue_and_name_the_flag(model, tokenizer):
    with in_process_node(model, tokenizer, admission="queue", max_running_requests=2, max_total_tokens=100) as node:
        node.prepare_receive("a", random_ids(30, 1), None)
        node.prepare_receive("b", random_ids(30, 2), None)
        with pytest.raises(DeadlineExceeded, match="--max-running-requests 2"):
            node.prepare_receive("c", random_ids(30, 3), None, deadline=time.monotonic() + 0.3)
        node.abort("b")
        with pytest.raises(DeadlineExceeded, match="--max-total-tokens 100"):
            node.prepare_receive("d", random_ids(71, 4), None, deadline=time.monotonic() + 0.3)
        node.prepare_receive("e", random_ids(70, 5), None)  # 30 + 70 tokens: exactly the cap
        assert_refused_at_once(node, "f", random_ids(101, 6), "can never run here", "too_large")
        abort_and_assert_pool_whole(node, "a", "e")


def test_abort_of_a_waiting_request_ends_its_wait(model, tokenizer):
    with in_process_node(model, tokenizer, admission="queue") as node, ThreadPoolExecutor(1) as pool:
        node.prepare_receive("hold", _prompt_for(16, 1), None)
        waiting: Future = pool.submit(node.prepare_receive, "w", random_ids(20, 2), None)
        wait_for(lambda: node.load().queued_requests == 1)
        node.abort("w")
        with pytest.raises(Aborted, match="waiting for admission"):
            waiting.result(timeout=5)
        abort_and_assert_pool_whole(node, "hold")


def test_cached_pages_are_evicted_instead_of_queuing(model, tokenizer):
    """A pool all but full of prefix-cache pages nobody uses admits at once."""
    with in_process_node(model, tokenizer, admission="queue") as node:
        prompt = _prompt_for(14, 1)
        handle = node.generate("cached", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while not handle.next_chunk(timeout=30).finish_reason:
            pass
        with node.engine.lock:
            cached = node.engine.prefix_cache.num_cached_pages
            assert cached >= 14 and node.engine.allocator.num_free <= POOL - 14
        node.prepare_receive("new", _prompt_for(15, 2), None, deadline=time.monotonic() + 2)
        with node.engine.lock:
            assert node.engine.prefix_cache.num_cached_pages <= POOL - 15
        assert node.metrics.registry.get_sample_value("duet_admission_wait_seconds_count") == 0
        abort_and_assert_pool_whole(node, "new")


# ---- end to end, through a real decode node daemon ----

@pytest.fixture(scope="module")
def queued(tmp_path_factory):
    """16 pages of 16 tokens, one kept free (watermark 0.1): one request may hold 15; one waiter."""
    with decode_node(tmp_path_factory.mktemp("dn_queue"), *FP32, "--kv-pages", str(POOL), "--threads", "1",
                     "--admission", "queue", "--max-queued-requests", "1", "--admission-watermark", "0.1") as d:
        yield d


def labelled(d, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def pool_whole(d) -> bool:
    m = d.metrics()
    return m["duet_kv_pages_free"] + m["duet_kv_pages_cached"] == m["duet_kv_pages_total"] and \
        m["duet_kv_pages_reserved"] == 0 and m["duet_admission_queue_depth"] == 0


def hold_the_pool(d, request_id: str) -> None:
    r = d.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=request_id, token_ids=_prompt_for(15, 99)))
    assert r.kv_window_end == 15 * PAGE


def test_a_waiting_prepare_receive_is_admitted_when_pages_free_up(queued):
    waited_before = queued.metrics().get("duet_admission_wait_seconds_count", 0)
    hold_the_pool(queued, "hold")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(queued.stub.PrepareReceive,
                              pb.PrepareReceiveRequest(request_id="w", token_ids=random_ids(50, 1)), timeout=30)
        wait_for(lambda: queued.metrics()["duet_admission_queue_depth"] == 1)
        assert queued.stub.GetLoad(pb.GetLoadRequest()).queued_requests == 1
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            queued.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="x", token_ids=random_ids(50, 2)), timeout=10)
        assert time.monotonic() - started < 1
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests" in info.value.details()
        hint = dict(info.value.trailing_metadata())  # when to come back, in seconds and as gRPC's pushback
        assert 1 <= int(hint["retry-after"]) <= 60 and int(hint["grpc-retry-pushback-ms"]) == 1000 * int(
            hint["retry-after"])
        assert labelled(queued, "duet_admission_refusals_total", reason="queue_full") == 1
        assert not waiting.done()
        queued.stub.Abort(pb.AbortRequest(request_id="hold"))
        assert waiting.result(timeout=10).kv_window_end == 49
    assert queued.metrics()["duet_admission_wait_seconds_count"] == waited_before + 1
    queued.stub.Abort(pb.AbortRequest(request_id="w"))
    wait_for(lambda: pool_whole(queued))


def test_waiters_whose_deadline_passes_or_who_cancel_leave_the_queue(queued):
    hold_the_pool(queued, "hold2")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        queued.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="late", token_ids=random_ids(50, 3)), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 2
    wait_for(lambda: queued.stub.GetLoad(pb.GetLoadRequest()).queued_requests == 0, timeout=2)
    call = queued.stub.PrepareReceive.future(pb.PrepareReceiveRequest(request_id="gone", token_ids=random_ids(50, 4)))
    wait_for(lambda: queued.stub.GetLoad(pb.GetLoadRequest()).queued_requests == 1)
    call.cancel()
    wait_for(lambda: queued.stub.GetLoad(pb.GetLoadRequest()).queued_requests == 0, timeout=2)
    queued.stub.Abort(pb.AbortRequest(request_id="hold2"))
    wait_for(lambda: pool_whole(queued))  # neither was admitted behind our back
    for request_id in ("late", "gone"):
        with pytest.raises(grpc.RpcError) as info:
            queued.stub.Abort(pb.AbortRequest(request_id=request_id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # gRPC ends a call whose deadline passed too: that one still counts as DEADLINE_EXCEEDED.
    for outcome in ("CANCELLED", "DEADLINE_EXCEEDED"):
        wait_for(lambda: labelled(queued, "duet_requests_total", rpc="PrepareReceive", outcome=outcome) == 1,
                 timeout=2)


def test_a_request_that_can_never_fit_is_refused_at_once(queued):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        queued.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="huge", token_ids=_prompt_for(16, 4)),
                                   timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 1
    assert "at most 15" in info.value.details() and "--kv-pages" in info.value.details()
    assert "retry-after" not in dict(info.value.trailing_metadata())  # it can never fit: no hint to come back
    assert pool_whole(queued)


def test_a_generate_that_waited_produces_the_reference_tokens(queued, tokenizer, hf_model):
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    want = hf_greedy(hf_model, ids, 8)
    hold_the_pool(queued, "hold3")
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(lambda: list(queued.stub.Generate(
            pb.GenerateRequest(request_id="gen", token_ids=ids, sampling=greedy(8)), timeout=60)))
        wait_for(lambda: queued.stub.GetLoad(pb.GetLoadRequest()).queued_requests == 1)
        time.sleep(0.2)
        assert not stream.done()
        queued.stub.Abort(pb.AbortRequest(request_id="hold3"))
        chunks = stream.result(timeout=60)
    assert [t for c in chunks for t in c.token_ids] == want
    assert chunks[-1].finish_reason == "length"
    wait_for(lambda: pool_whole(queued))
