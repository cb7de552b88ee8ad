"""KV events on real daemons, and the router's prefix-aware routing fed by them: two decode nodes
and a prefill node behind a router, all real processes."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.kv.block_hashes import block_hashes
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node, router
from harness.helpers import Started, random_ids, wait_for
from harness.reference import engine_greedy

PS = 16
NODE_FLAGS = ("--dtype", "float32", "--page-size", str(PS), "--kv-pages", "512")


def ask(stub, prompt: list[int], n: int = 4) -> tuple[list[int], pb.Usage]:
    request = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
    chunks = list(stub.Generate(request, timeout=300))
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


def first_events(stub, request: pb.WatchKvEventsRequest, n: int, timeout: float = 20.0) -> list[pb.KvEvent]:
    call = stub.WatchKvEvents(request, timeout=timeout)
    events = []
    for event in call:
        events.append(event)
        if len(events) == n:
            break
    call.cancel()
    return events


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_routing")
    with Started(tmp) as s:
        pf = s.spawn("prefill_node", *NODE_FLAGS)
        flags = (*NODE_FLAGS, "--prefill", pf.address, "--min-remote-prefill-tokens", "8")
        d1, d2 = s.spawn("decode_node", *flags), s.spawn("decode_node", *flags)
        s.wait()
        members = tmp / "members.json"
        members.write_text(json.dumps({"decode": [d1.address, d2.address], "prefill": [pf.address]}))
        with router(tmp, "--members", str(members), "--poll-seconds", "0.2", "--min-remote-prefill-tokens", "8") as rt:
            wait_for(lambda: rt.metrics().get("duet_router_healthy_decode_nodes") == 2)
            yield tmp, rt, d1, d2, pf, flags


def test_watch_opens_with_a_snapshot_then_streams_the_blocks_a_request_leaves(nodes):
    _, _, d1, _, _, _ = nodes
    watch = d1.stub.WatchKvEvents(pb.WatchKvEventsRequest(), timeout=60)
    snapshot = next(watch)
    assert snapshot.snapshot and snapshot.block_size == PS and snapshot.incarnation
    prompt = random_ids(70, 1)
    threading.Thread(target=ask, args=(d1.stub, prompt), daemon=True).start()
    stored: set[int] = set()
    sequence = snapshot.sequence
    for event in watch:
        assert not event.snapshot and event.sequence == sequence + 1  # consecutive, no gap
        sequence = event.sequence
        stored.update(event.stored_blocks)
        if set(block_hashes(prompt, PS)) <= stored:
            break
    watch.cancel()
    assert d1.metrics()["duet_prefix_cache_blocks"] >= len(block_hashes(prompt, PS))
    before = d1.metrics()["duet_prefix_cache_hit_tokens_total"]
    _, usage = ask(d1.stub, prompt)
    assert usage.cached_tokens >= 64 and d1.metrics()["duet_prefix_cache_hit_tokens_total"] - before >= 64


def test_a_watch_resumes_where_it_left_off_and_refuses_bad_resume_points(nodes):
    _, _, d1, _, _, _ = nodes
    ask(d1.stub, random_ids(40, 2))
    (snapshot,) = first_events(d1.stub, pb.WatchKvEventsRequest(), 1)
    assert snapshot.sequence >= 1
    # One change back: replayed, not a snapshot.
    (replayed,) = first_events(d1.stub, pb.WatchKvEventsRequest(
        incarnation=snapshot.incarnation, after_sequence=snapshot.sequence - 1), 1)
    assert not replayed.snapshot and replayed.sequence == snapshot.sequence
    # Another incarnation (this node restarted since): a snapshot.
    (fresh,) = first_events(d1.stub, pb.WatchKvEventsRequest(incarnation="gone", after_sequence=3), 1)
    assert fresh.snapshot
    bad = [(pb.WatchKvEventsRequest(after_sequence=1), grpc.StatusCode.INVALID_ARGUMENT),
           (pb.WatchKvEventsRequest(incarnation="x" * 300), grpc.StatusCode.INVALID_ARGUMENT),
           (pb.WatchKvEventsRequest(incarnation=snapshot.incarnation, after_sequence=snapshot.sequence + 10**6),
            grpc.StatusCode.OUT_OF_RANGE)]
    for request, code in bad:
        with pytest.raises(grpc.RpcError) as err:
            first_events(d1.stub, request, 1)
        assert err.value.code() == code


def test_conversation_turns_follow_their_cache_and_the_prefill_node_reports_its_own(nodes, model):
    _, rt, d1, d2, pf, _ = nodes
    history = random_ids(200, 3)
    tokens, usage = ask(rt.stub, history)
    assert tokens == engine_greedy(model, history, 4)
    hits = [d.metrics()["duet_prefix_cache_hit_tokens_total"] for d in (d1, d2)]
    for turn in range(4):  # each turn: the history so far, the answer, a new question
        history = history + tokens + random_ids(20, 10 + turn)
        tokens, usage = ask(rt.stub, history)
        assert usage.cached_tokens >= len(history) - 20 - len(tokens) - PS
    gained = [d.metrics()["duet_prefix_cache_hit_tokens_total"] - h for d, h in zip((d1, d2), hits)]
    assert min(gained) == 0 and max(gained) > 4 * 150  # one node served every turn from its cache
    (snapshot,) = first_events(pf.stub, pb.WatchKvEventsRequest(), 1)
    assert snapshot.snapshot and set(block_hashes(history[:200], PS)[:12]) <= set(snapshot.stored_blocks)
    assert pf.metrics()["duet_prefix_cache_blocks"] == len(snapshot.stored_blocks)
    before = pf.metrics()["duet_prefix_cache_hit_tokens_total"]
    other = [d for d, g in zip((d1, d2), gained) if g == 0][0]
    ask(other.stub, history[:200] + random_ids(50, 99))  # the other decode node hands a known prefix over
    assert pf.metrics()["duet_prefix_cache_hit_tokens_total"] - before >= 192


def test_a_restarted_decode_node_is_resynced_and_no_request_fails(nodes, model):
    tmp, rt, d1, d2, _, flags = nodes
    prompts = [random_ids(120, 40 + i) for i in range(6)]
    expected = [engine_greedy(model, p, 4) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ask, rt.stub, p) for p in prompts]
        time.sleep(0.5)
        d2.stop(signal.SIGTERM)  # drains what it runs; new requests go to d1
        results = [f.result()[0] for f in futures]
    assert results == expected
    with decode_node(tmp, *flags, port=d2.port) as again:
        wait_for(lambda: rt.metrics().get("duet_router_healthy_decode_nodes") == 2)
        ask(again.stub, random_ids(64, 77))
        # The router's index agrees with what both nodes hold, the restarted one included.
        wait_for(lambda: rt.metrics()["duet_router_kv_index_blocks"] ==
                 d1.metrics()["duet_prefix_cache_blocks"] + again.metrics()["duet_prefix_cache_blocks"])
