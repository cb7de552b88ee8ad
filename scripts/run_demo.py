"""`make run`: start a prefill node and a decode node on localhost with the embedded model,
show one readable chat completion (gRPC) and two parallel samples of one prompt through the
OpenAI-compatible HTTP front, run a short loadgen workload through the pair, print the report,
and stop both daemons cleanly."""
from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadgen import BenchmarkConfig, format_table, run_benchmark
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node, free_port, prefill_node

QUESTION = "Explain in two sentences why splitting prefill and decode onto different machines helps."


def chat(node) -> None:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=QUESTION)],
                                 sampling=pb.SamplingParams(max_tokens=80, temperature=0.0))
    print(f"user> {QUESTION}\nassistant> ", end="", flush=True)
    started, first = time.perf_counter(), None
    for chunk in node.stub.Generate(request):
        first = first or time.perf_counter()
        print(chunk.text, end="", flush=True)
        last = chunk
    u = last.usage
    print(f"\n  [prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), {u.completion_tokens} generated, "
          f"TTFT {1000 * (first - started):.0f} ms, finish={last.finish_reason}]\n", flush=True)


def openai_completion(port: int) -> None:
    """Two parallel samples (`n=2`) of one prompt from `/v1/completions`, as any OpenAI client sends it."""
    base = f"http://127.0.0.1:{port}/v1"
    model = json.load(urllib.request.urlopen(f"{base}/models", timeout=10))["data"][0]["id"]
    body = {"model": model, "prompt": "The two phases of LLM inference are", "max_tokens": 24,
            "temperature": 0.8, "seed": 7, "n": 2}
    print(f"curl {base}/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
    request = urllib.request.Request(f"{base}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = json.load(urllib.request.urlopen(request, timeout=120))
    for choice in response["choices"]:
        print(f"  choice {choice['index']} ({choice['finish_reason']}): {body['prompt'] + choice['text']!r}")
    print(f"  usage: {response['usage']}\n", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        print("starting a prefill node and a decode node (NIXL over UCX shared memory) ...", flush=True)
        openai_port = free_port()
        with prefill_node(Path(tmp)) as pn, \
                decode_node(Path(tmp), "--prefill", pn.address, "--min-remote-prefill-tokens", "16",
                            "--openai-port", str(openai_port)) as dn:
            print(f"prefill node {pn.address}, decode node {dn.address} (OpenAI API on port {openai_port}): "
                  "both healthy\n", flush=True)
            chat(dn)
            openai_completion(openai_port)
            print("loadgen: 24 requests, Poisson 1 req/s, ~256-token prompts, 32 output tokens", flush=True)
            config = BenchmarkConfig(target=dn.address, num_requests=24, request_rate=1.0, input_len=256,
                                     output_len=32, range_ratio=0.5, seed=1,
                                     goodput={"ttft": 2000.0, "tpot": 250.0})
            print(format_table(run_benchmark(config)))
            computed = pn.metrics()["duet_prefill_computed_tokens_total"]
            print(f"prefill node computed {computed:.0f} prompt tokens and pushed their KV to the decode node")
        print("daemons stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
