"""python -m loadgen: arrivals, datasets, and whole runs against real decode nodes, over duet's gRPC
and over the node's own OpenAI HTTP front (`--openai-port`)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from loadgen import BenchmarkConfig, format_table, run_benchmark
from loadgen.arrivals import arrival_offsets
from loadgen.config import CHAT
from loadgen.datasets import TOKEN_ID_RANGE, file_dataset, random_dataset, shared_prefix_dataset
from loadgen import grpc_client
from loadgen.grpc_client import GrpcTarget
from loadgen.plot import figure
from loadgen.request_result import RequestResult
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import ROOT, decode_node, free_port

SUMMARY_FIELDS = {
    "completed", "failed", "failed_by_status", "duration_s", "total_input_tokens", "total_output_tokens",
    "total_cached_tokens", "total_cacheable_tokens", "request_throughput", "output_throughput", "total_token_throughput", "goodput",
    "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
}
REQUEST_FIELDS = {
    "index", "request_id", "status", "error", "finish_reason", "arrival_s", "start_s", "first_token_s", "end_s", "ttft_ms",
    "tpot_ms", "e2el_ms", "itl_ms", "prompt_tokens", "completion_tokens", "cached_tokens", "cacheable_tokens", "retries",
    "text",
}
STATS = {"mean", "median", "p90", "p99"}


def loadgen(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadgen", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A decode node serving gRPC and, at `node.http`, the OpenAI API."""
    port = free_port()
    with decode_node(tmp_path_factory.mktemp("loadgen_dn"), "--transport", "tcp", "--openai-port", str(port)) as d:
        d.http = f"http://127.0.0.1:{port}"
        yield d


# ---------------------------------------------------------------- arrivals and datasets (no daemons)

def test_poisson_arrivals_have_the_requested_mean_and_unit_cv():
    offsets = arrival_offsets(20_001, rate=5.0, burstiness=1.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness):
    rate = 10.0
    gaps = np.diff(arrival_offsets(20_001, rate=rate, burstiness=burstiness, seed=2))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.var() == pytest.approx(1 / (burstiness * rate**2), rel=0.15)


def test_burstier_arrivals_vary_more_and_same_seed_repeats():
    variances = [np.diff(arrival_offsets(5_001, 2.0, b, seed=3)).var() for b in (0.5, 1.0, 2.0)]
    assert variances[0] > variances[1] > variances[2]
    assert np.array_equal(arrival_offsets(50, 2.0, 1.0, seed=4), arrival_offsets(50, 2.0, 1.0, seed=4))


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_offsets(7, math.inf, 0.5, seed=0), np.zeros(7))


def test_synthetic_datasets_have_exact_lengths():
    fixed = random_dataset(20, input_len=50, output_len=7, range_ratio=0.0, seed=0)
    assert all(len(s.token_ids) == 50 and s.output_len == 7 for s in fixed)
    assert all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for s in fixed for t in s.token_ids)
    ranged = random_dataset(200, input_len=100, output_len=10, range_ratio=0.5, seed=0)
    assert {len(s.token_ids) for s in ranged} <= set(range(50, 151)) and len({len(s.token_ids) for s in ranged}) > 10
    assert all(5 <= s.output_len <= 15 for s in ranged)
    shared = shared_prefix_dataset(12, num_groups=3, prefix_len=40, input_len=8, output_len=4, range_ratio=0, seed=1)
    prefixes = {s.token_ids[:40] for s in shared}
    assert len(prefixes) == 3 and all(len(s.token_ids) == 48 for s in shared)
    assert sorted(sum(s.token_ids[:40] == p for s in shared) for p in prefixes) == [4, 4, 4]


def test_file_datasets_jsonl_and_sharegpt(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "Hello"}\n\n{"prompt": "Name a colour."}\n')
    samples = file_dataset(jsonl, 5, output_len=3, seed=0)
    assert len(samples) == 5 and {s.prompt for s in samples} == {"Hello", "Name a colour."}
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    samples = file_dataset(sharegpt, 2, output_len=3, seed=0)
    assert [s.messages for s in samples] == [(("user", "What is 2+2?"),)] * 2


def test_conversations_share_a_system_prompt_and_multi_turn_files_keep_their_order(tmp_path):
    config = BenchmarkConfig(target="x", dataset="conversations", num_users=3, turns=2, prefix_len=20, input_len=8)
    conversations = config.conversations()
    assert len(conversations) == 3 and len({c.system for c in conversations}) == 1
    assert all(len(c.questions) == 2 and c.system not in c.questions for c in conversations)
    assert config.conversations() == conversations and config.openai_endpoint == CHAT  # seeded; chats
    turn = conversations[0].turn((("user", "q"), ("assistant", "a")), "next?")
    assert turn.messages == (("system", conversations[0].system), ("user", "q"), ("assistant", "a"), ("user", "next?"))
    sharegpt = tmp_path / "multi.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "A?"},
                           {"from": "gpt", "value": "recorded, unused"}, {"from": "human", "value": "B?"},
                           {"from": "human", "value": "C?"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    (only,) = dataclasses.replace(config, dataset=str(sharegpt), multi_turn=True).conversations()
    assert (only.system, only.questions) == ("Be terse.", ("A?", "B?"))
    for bad in ({"multi_turn": True}, {"turns": 0}, {"endpoint": "/v1/completions"}, {"think_time": -1}):
        with pytest.raises(ValueError):
            dataclasses.replace(config, **bad)
    agents = dataclasses.replace(config, dataset="agentic").conversations()  # a system prompt each
    assert len({c.system for c in agents}) == 3 and all(len(c.questions) == 2 for c in agents)


# ---------------------------------------------------------------- whole runs against decode nodes

def test_conversation_turns_wait_for_their_answers_and_count_cacheable_tokens(node, tmp_path):
    out = tmp_path / "chat.json"
    done = loadgen("--target", node.address, "--dataset", "conversations", "--num-users", "2", "--turns", "3",
                   "--prefix-len", "48", "--input-len", "12", "--output-len", "6", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "Cacheable prompt tokens:" in done.stdout and "Cached / cacheable:" in done.stdout
    data = json.loads(out.read_text())
    requests = data["requests"]
    assert len(requests) == 6 and all(r["status"] == "OK" for r in requests)
    for user in (requests[:3], requests[3:]):
        for earlier, later in zip(user, user[1:]):
            assert later["start_s"] >= earlier["end_s"]  # the next turn waits for the answer
            assert later["prompt_tokens"] > earlier["prompt_tokens"] + earlier["completion_tokens"]
            assert later["cacheable_tokens"] >= earlier["prompt_tokens"]  # its whole history
    summary = data["summary"]
    assert summary["total_cacheable_tokens"] == sum(r["cacheable_tokens"] for r in requests)
    assert 0.8 * summary["total_cacheable_tokens"] <= summary["total_cached_tokens"]  # one node: all its own
    # Over HTTP the same conversations, with the cached tokens the front reports.
    http = run_benchmark(BenchmarkConfig(target=node.http, dataset="conversations", num_users=1, turns=2,
                                         prefix_len=48, input_len=12, output_len=6), progress=None)
    assert http.summary.completed == 2 and http.requests[1].cached_tokens >= http.requests[0].prompt_tokens - 16


def test_run_against_a_decode_node_writes_json_and_png(node, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    done = loadgen("--target", node.address, "--num-requests", "4", "--request-rate", "inf",
                   "--max-concurrency", "2", "--input-len", "24", "--output-len", "4", "--seed", "7",
                   "--goodput", "ttft:60000", "tpot:60000", "e2el:60000", "--output", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Goodput (req/s)" in done.stdout
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert set(summary) == SUMMARY_FIELDS
    assert summary["completed"] == 4 and summary["failed"] == 0 and summary["failed_by_status"] == {}
    assert summary["total_output_tokens"] == 16 and summary["total_input_tokens"] == 96
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[name]) == STATS and 0 < summary[name]["median"] <= summary[name]["p99"]
    assert data["config"]["request_rate"] == "inf" and data["config"]["goodput"]["ttft"] == 60000
    assert len(data["requests"]) == 4
    for r in data["requests"]:
        assert set(r) == REQUEST_FIELDS
        assert r["status"] == "OK" and r["finish_reason"] == "length" and r["retries"] == 0
        assert r["prompt_tokens"] == 24 and r["completion_tokens"] == 4
        assert 1 <= len(r["itl_ms"]) <= 3
        assert r["arrival_s"] <= r["start_s"] < r["first_token_s"] <= r["end_s"]
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / 3)
    # --max-concurrency 2: never more than two requests in flight.
    events = sorted([(r["start_s"], 1) for r in data["requests"]] + [(r["end_s"], -1) for r in data["requests"]])
    assert max(np.cumsum([step for _, step in events])) <= 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_in_process_api_with_shared_prefix_and_text_datasets(node, tmp_path, tokenizer):
    config = BenchmarkConfig(target=node.address, num_requests=2, input_len=16, output_len=3,
                             dataset="shared-prefix", num_prefix_groups=1, prefix_len=32, seed=1)
    result = run_benchmark(config, progress=None)
    assert result.summary.completed == 2 and [r.completion_tokens for r in result.requests] == [3, 3]
    assert all(r.prompt_tokens == 48 for r in result.requests)
    assert "Successful requests:" in format_table(result)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n')
    result = run_benchmark(BenchmarkConfig(target=node.address, num_requests=1, output_len=2, dataset=str(prompts)),
                           progress=None)
    assert result.summary.completed == 1
    assert result.requests[0].prompt_tokens == len(tokenizer.encode("The capital of France is"))


def test_compare_prints_ratios(node):
    done = loadgen("--target", node.address, "--compare", node.address, "--num-requests", "2",
                   "--input-len", "16", "--output-len", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert ["metric", "target", "compare", "ratio"] in [line.split() for line in lines]
    successful = next(line for line in lines if line.startswith("Successful requests"))
    assert successful.split()[-3:] == ["2", "2", "1.00x"]
    assert any(line.startswith("Mean TTFT (ms)") and line.endswith("x") for line in lines)


def test_unreachable_target_fails_every_request_with_its_status(tmp_path):
    out = tmp_path / "down.json"
    done = loadgen("--target", f"127.0.0.1:{free_port()}", "--num-requests", "3", "--input-len", "8",
                   "--output-len", "2", "--output", str(out), timeout=30)
    assert done.returncode == 1, done.stderr  # ran to the end, but nothing completed
    assert "Failed requests:" in done.stdout and "UNAVAILABLE" in done.stdout
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 0 and data["summary"]["failed"] == 3
    assert data["summary"]["failed_by_status"] == {"UNAVAILABLE": 3}
    assert all(r["status"] == "UNAVAILABLE" and r["error"] for r in data["requests"])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_target_dying_mid_run_yields_failed_counts(tmp_path, protocol):
    out = tmp_path / "dying.json"
    port = free_port()
    with decode_node(tmp_path, "--transport", "tcp", "--openai-port", str(port)) as doomed:
        target = doomed.address if protocol == "grpc" else f"http://127.0.0.1:{port}"
        run = subprocess.Popen(
            [sys.executable, "-m", "loadgen", "--no-progress", "--target", target, "--num-requests", "4",
             "--max-concurrency", "2", "--input-len", "16", "--output-len", "1000", "--output", str(out)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while doomed.metrics().get("duet_ttft_seconds_count", 0) < 1:  # a stream is under way
                assert run.poll() is None and time.monotonic() < deadline, "no request got going"
                time.sleep(0.1)
            doomed.proc.send_signal(signal.SIGKILL)
            stdout, stderr = run.communicate(timeout=30)
        finally:
            if run.poll() is None:
                run.kill()
    assert run.returncode in (0, 1) and "Traceback" not in stderr, stderr
    assert "Failed requests:" in stdout
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["completed"] + summary["failed"] == 4
    # gRPC: a cut stream and a refused connection are both UNAVAILABLE. HTTP: the API server outlives its
    # daemon a moment, so a stream under way ends with its in-band error, and later requests get a 503
    # or, once it has exited too, no connection.
    cut, others = ("UNAVAILABLE", set()) if protocol == "grpc" else (
        "STREAM_ERROR", {"STREAM_CUT", "CONNECT_ERROR", "DISCONNECTED", "HTTP_503"})
    assert summary["failed"] >= 3 and summary["failed_by_status"].get(cut, 0) >= 1, summary["failed_by_status"]
    assert set(summary["failed_by_status"]) <= {cut} | others
    assert all(r["error"] for r in data["requests"] if r["status"] != "OK")


class _DiesOnceNode(duet_pb2_grpc.DecodeNodeServicer):
    """A target that streams two tokens then goes UNAVAILABLE (as a killed router's stream does) and,
    asked again, goes on from the tokens the client holds: a target restarted on its port."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def Generate(self, request, context):
        held = [list(s.generated_token_ids) for s in request.continuation.samples]
        self.calls.append(held[0] if held else [])
        if not held:
            yield pb.GenerationChunk(token_ids=[11, 12])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going down")
        yield pb.GenerationChunk(token_ids=[13], finish_reason="length",
                                 usage=pb.Usage(prompt_tokens=8, completion_tokens=3))


def test_a_request_goes_round_its_targets_back_to_one_that_came_back(monkeypatch):
    """A killed, B down: the request returns to A (back on its port) with its tokens, after a pause;
    with every target down it ends UNAVAILABLE after ROUNDS rounds, never sooner, never a hang."""
    monkeypatch.setattr(grpc_client, "ROUND_PAUSE_S", 0.05)
    sample = random_dataset(1, input_len=8, output_len=3, range_ratio=0.0, seed=0)[0]

    async def run(fallback_ok: bool) -> tuple[RequestResult, list[list[int]]]:
        server, servicer = grpc.aio.server(), _DiesOnceNode()
        duet_pb2_grpc.add_DecodeNodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        down = f"127.0.0.1:{free_port()}"
        target = f"127.0.0.1:{port}" if fallback_ok else down
        try:
            async with GrpcTarget(BenchmarkConfig(target=target, fallbacks=(down,), timeout=10)) as t:
                return await t.send(0, "r0", sample, origin=time.perf_counter(), arrival=0.0), servicer.calls
        finally:
            await server.stop(None)

    result, calls = asyncio.run(run(True))
    assert (result.status, result.token_ids, result.finish_reason) == ("OK", [11, 12, 13], "length")
    assert result.retries == 2 and calls == [[], [11, 12]]  # A, B (down), A again with what it had sent
    result, calls = asyncio.run(run(False))
    assert result.status == "UNAVAILABLE" and result.retries == grpc_client.ROUNDS * 2 - 1 and calls == []


# ---------------------------------------------------------------- the same workloads over OpenAI HTTP

def test_http_completions_give_the_grpc_runs_tokens_and_usage(node, tmp_path):
    """Greedy token-id prompts: /v1/completions streams the very text gRPC does, usage counts agree."""
    config = BenchmarkConfig(target=node.address, num_requests=3, input_len=20, output_len=6, seed=11)
    grpc_run = run_benchmark(config, progress=None)
    out, png = tmp_path / "http.json", tmp_path / "http.png"
    done = loadgen("--target", node.http, "--label", "duet-http", "--num-requests", "3", "--input-len", "20",
                   "--output-len", "6", "--seed", "11", "--output", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert "duet-http" in done.stdout and node.http in done.stdout
    data = json.loads(out.read_text())
    assert data["label"] == "duet-http" and data["target"] == node.http
    assert data["model"] == json.loads(urllib.request.urlopen(f"{node.http}/v1/models").read())["data"][0]["id"]
    assert data["summary"]["completed"] == 3 and data["summary"]["total_input_tokens"] == 60
    for over_http, over_grpc in zip(data["requests"], grpc_run.requests):
        assert over_grpc.ok and over_http["status"] == "OK" and over_http["finish_reason"] == "length"
        assert over_http["text"] == over_grpc.text and over_grpc.text
        assert (over_http["prompt_tokens"], over_http["completion_tokens"]) == (20, 6) == \
            (over_grpc.prompt_tokens, over_grpc.completion_tokens)
        assert over_http["first_token_s"] <= over_http["end_s"] and len(over_http["itl_ms"]) >= 1


def test_http_chat_gives_the_grpc_runs_tokens(node, tmp_path):
    """A ShareGPT file goes as chat messages over both protocols: same answers, same usage."""
    sharegpt = tmp_path / "chat.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}]}
                                    for q in ("Name a primary colour.", "What is the capital of Italy?")]))
    config = BenchmarkConfig(target=node.address, num_requests=2, dataset=str(sharegpt), output_len=8, seed=2)
    grpc_run = run_benchmark(config, progress=None)
    http_run = run_benchmark(dataclasses.replace(config, target=node.http, endpoint=CHAT), progress=None)
    assert http_run.summary.completed == 2 and grpc_run.summary.completed == 2
    for over_http, over_grpc in zip(http_run.requests, grpc_run.requests):
        assert over_http.text == over_grpc.text and over_http.text
        assert (over_http.prompt_tokens, over_http.completion_tokens, over_http.finish_reason) == \
            (over_grpc.prompt_tokens, over_grpc.completion_tokens, over_grpc.finish_reason)
    # Token-id prompts become chat text (decoded with the embedded model's tokenizer), over either protocol.
    config = BenchmarkConfig(target=node.http, endpoint=CHAT, num_requests=2, input_len=12, output_len=3, seed=4)
    http_run = run_benchmark(config, progress=None)
    grpc_run = run_benchmark(dataclasses.replace(config, target=node.address), progress=None)
    assert [(r.ok, r.prompt_tokens, r.completion_tokens, r.text) for r in http_run.requests] == \
        [(r.ok, r.prompt_tokens, r.completion_tokens, r.text) for r in grpc_run.requests]
    assert all(r.ok and r.prompt_tokens > 12 and r.completion_tokens == 3 for r in http_run.requests)  # + template


def test_http_failures_are_counted_with_the_servers_reasons(node, tmp_path):
    out = tmp_path / "bad_model.json"
    done = loadgen("--target", node.http, "--model", "no-such-model", "--num-requests", "2", "--input-len", "8",
                   "--output-len", "2", "--output", str(out))
    assert done.returncode == 1 and "HTTP_404" in done.stdout
    data = json.loads(out.read_text())
    assert data["summary"]["failed_by_status"] == {"HTTP_404": 2}
    assert all("no-such-model" in r["error"] and "does not exist" in r["error"] for r in data["requests"])
    # A prompt past the model's context: the node's refusal, as the front answers it, per request.
    too_long = run_benchmark(BenchmarkConfig(target=node.http, num_requests=1, input_len=9000, output_len=2),
                             progress=None)
    assert too_long.summary.failed_by_status == {"HTTP_400": 1} and too_long.requests[0].error
    down = run_benchmark(BenchmarkConfig(target=f"http://127.0.0.1:{free_port()}", num_requests=3, input_len=8,
                                         output_len=2), progress=None)
    assert down.summary.failed_by_status == {"CONNECT_ERROR": 3} and all(r.error for r in down.requests)


def test_grpc_only_flags_are_refused_for_http_targets_and_vice_versa():
    done = loadgen("--target", "http://127.0.0.1:1", "--trace", "t.json")
    assert done.returncode == 2 and "--trace" in done.stderr
    done = loadgen("--target", "127.0.0.1:1", "--model", "m")
    assert done.returncode == 2 and "http(s):// targets only" in done.stderr
    for targets in ("127.0.0.1:1", "127.0.0.1:1,", "http://127.0.0.1:1,127.0.0.1:2"):
        done = loadgen("--targets", targets)
        assert done.returncode == 2 and "give two or more duet gRPC HOST:PORT" in done.stderr, targets
    done = loadgen("--targets", "127.0.0.1:1,127.0.0.1:2", "--target", "127.0.0.1:3")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


def test_labels_name_the_runs_in_table_json_and_plot(node, tmp_path):
    out = tmp_path / "labelled.json"
    done = loadgen("--target", node.address, "--label", "over-grpc", "--compare", node.http,
                   "--compare-label", "over-http", "--num-requests", "2", "--input-len", "8", "--output-len", "3",
                   "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert ["metric", "over-grpc", "over-http", "ratio"] in [line.split() for line in done.stdout.splitlines()]
    data = json.loads(out.read_text())
    assert (data["label"], data["compare"]["label"]) == ("over-grpc", "over-http")
    assert data["compare"]["target"] == node.http and data["compare"]["summary"]["completed"] == 2
    config = BenchmarkConfig(target=node.address, label="over-grpc", num_requests=1, input_len=8, output_len=3)
    first = run_benchmark(config, progress=None)
    second = run_benchmark(dataclasses.replace(config, target=node.http, label="over-http"), progress=None)
    fig = figure(first, second)
    legends = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    titles = [ax.get_title() for ax in fig.axes]
    assert {"over-grpc", "over-http"} <= legends
    assert f"Timeline: over-http ({node.http})" in titles and f"Timeline: over-grpc ({node.address})" in titles
