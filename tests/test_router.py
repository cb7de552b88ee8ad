"""The router daemon over two prefill nodes and a decode node, all real processes."""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.duet.v1 import duet_pb2 as pb
from scripts.local_daemons import router
from tests.helpers import Started, random_ids
from tests.reference import FP32, engine_greedy


def generate(stub, prompt: list[int], n: int = 6) -> list[int]:
    request = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
    return [t for chunk in stub.Generate(request, timeout=300) for t in chunk.token_ids]


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    with Started(tmp) as s:
        p1, p2, dn = s.spawn("prefill_node", *FP32), s.spawn("prefill_node", *FP32), s.spawn("decode_node", *FP32)
        s.wait()
        members = tmp / "members.json"
        members.write_text(json.dumps({"decode": [dn.address], "prefill": [p1.address, p2.address]}))
        with router(tmp, "--members", str(members), "--poll-seconds", "0.2", "--min-remote-prefill-tokens", "8") as rt:
            wait_for(lambda: rt.metrics().get("duet_router_healthy_prefill_nodes") == 2)
            yield rt, dn, p1, p2, members


def test_routed_generation_equals_single_node(cluster, model):
    rt, _, p1, p2, _ = cluster
    for n in (5, 40, 300):  # 5 tokens stays local (below the threshold)
        prompt = random_ids(n, n)
        assert generate(rt.stub, prompt) == engine_greedy(model, prompt, 6)
    computed = p1.metrics()["duet_prefill_computed_tokens_total"] + p2.metrics()["duet_prefill_computed_tokens_total"]
    assert computed == 39 + 299


def test_membership_file_changes_apply_while_running(cluster, model):
    rt, dn, p1, p2, members = cluster
    members.write_text(json.dumps({"decode": [dn.address], "prefill": [p2.address]}))
    wait_for(lambda: rt.metrics().get("duet_router_healthy_prefill_nodes") == 1)
    before = p1.metrics()["duet_prefill_computed_tokens_total"]
    prompt = random_ids(100, 1)
    assert generate(rt.stub, prompt) == engine_greedy(model, prompt, 6)
    assert p1.metrics()["duet_prefill_computed_tokens_total"] == before  # p1 is out
    members.write_text(json.dumps({"decode": [dn.address], "prefill": [p1.address, p2.address]}))
    wait_for(lambda: rt.metrics().get("duet_router_healthy_prefill_nodes") == 2)


def test_prefill_node_killed_while_requests_run(cluster, model):
    rt, _, p1, _, _ = cluster
    prompts = [random_ids(400, 50 + i) for i in range(6)]
    expected = [engine_greedy(model, p, 6) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, rt.stub, p) for p in prompts]
        time.sleep(1.0)
        p1.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert results == expected
