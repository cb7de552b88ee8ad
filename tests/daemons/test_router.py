"""The router daemon over two prefill nodes and a decode node, all real processes."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import ROOT, router
from harness.helpers import Started, random_ids, wait_for
from harness.reference import FP32, engine_greedy


def generate(stub, prompt: list[int], n: int = 6) -> list[int]:
    request = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
    return [t for chunk in stub.Generate(request, timeout=300) for t in chunk.token_ids]


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


def test_a_retry_waits_for_its_decode_node_to_let_go_of_the_lost_instance(cluster, model):
    """A client retrying here a request whose router died before any token (the same request id)
    can find it still live on the decode node, mid hand-off: the router waits for the node to let
    go of it, rather than answering ALREADY_EXISTS."""
    rt, dn, _, _, _ = cluster
    prompt = random_ids(60, 9)
    dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="lost", token_ids=prompt), timeout=10)
    threading.Timer(1.0, lambda: dn.stub.Abort(pb.AbortRequest(request_id="lost"), timeout=10)).start()
    started = time.monotonic()
    request = pb.GenerateRequest(request_id="lost", token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
    assert [t for chunk in rt.stub.Generate(request, timeout=60) for t in chunk.token_ids] == \
        engine_greedy(model, prompt, 6)
    assert time.monotonic() - started >= 1.0


def test_a_malformed_client_continuation_is_refused(cluster):
    import grpc

    rt = cluster[0]
    for indices in ([], [1], [0, 0]):
        request = pb.GenerateRequest(token_ids=random_ids(20, 1), sampling=pb.SamplingParams(max_tokens=8))
        request.continuation.CopyFrom(pb.Continuation(samples=[pb.SampleContinuation(index=i) for i in indices]))
        with pytest.raises(grpc.RpcError) as refused:
            list(rt.stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "continuation.samples" in refused.value.details()


def test_a_killed_routers_clients_go_on_at_the_other_router(cluster, model, tmp_path):
    """A router that dies ends its streams with UNAVAILABLE at once; a client that asks another
    router for the rest with the tokens it holds (a Continuation) gets the completion an
    unbroken stream gives, and loadgen --targets does so for a whole run."""
    import subprocess
    import sys

    import grpc

    from loadgen.config import BenchmarkConfig
    from loadgen.runner import run_benchmark

    _, dn, _, _, members = cluster
    flags = ("--members", str(members), "--poll-seconds", "0.2", "--min-remote-prefill-tokens", "8")
    with router(tmp_path, *flags) as other:
        with router(tmp_path, *flags) as doomed:
            prompt = random_ids(60, 7)
            request = pb.GenerateRequest(request_id="cut", token_ids=prompt,
                                         sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True))
            received, stream = [], doomed.stub.Generate(request, timeout=300)
            for chunk in stream:
                received += chunk.token_ids
                if len(received) >= 5:
                    break
            doomed.proc.send_signal(signal.SIGKILL)
            cut = time.monotonic()
            with pytest.raises(grpc.RpcError) as broken:
                for chunk in stream:
                    received += chunk.token_ids
            assert broken.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - cut < 5.0
        request.continuation.CopyFrom(pb.Continuation(samples=[pb.SampleContinuation(
            index=0, generated_token_ids=received)]))
        rest = [t for chunk in other.stub.Generate(request, timeout=300) for t in chunk.token_ids]
        assert received + rest == engine_greedy(model, prompt, 40)

        workload = ("--num-requests", "4", "--max-concurrency", "2", "--input-len", "24", "--output-len", "32",
                    "--seed", "3")
        reference = run_benchmark(BenchmarkConfig(target=other.address, num_requests=4, max_concurrency=2,
                                                  input_len=24, output_len=32, seed=3), progress=None)
        with router(tmp_path, *flags) as doomed:
            run = subprocess.Popen(
                [sys.executable, "-m", "loadgen", "--no-progress", "--targets", f"{doomed.address},{other.address}",
                 *workload, "--output", str(tmp_path / "retried.json")],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                started = dn.metrics().get("duet_ttft_seconds_count", 0)
                wait_for(lambda: dn.metrics().get("duet_ttft_seconds_count", 0) >= started + 2)  # streams under way
                doomed.proc.send_signal(signal.SIGKILL)
                _, stderr = run.communicate(timeout=120)
            finally:
                if run.poll() is None:
                    run.kill()
    assert run.returncode == 0, stderr
    retried = json.loads((tmp_path / "retried.json").read_text())
    assert retried["summary"]["completed"] == 4
    assert any(r["retries"] == 1 for r in retried["requests"])  # went on at the other router
    assert {r["index"]: r["text"] for r in retried["requests"]} == {r.index: r.text for r in reference.requests}
