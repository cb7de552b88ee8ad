"""`make run`: start a prefill node and a decode node on localhost with the embedded model,
show one readable chat completion, run a short loadgen workload through the pair, print the
report, and stop both daemons cleanly."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from loadgen import BenchmarkConfig, format_table, run_benchmark
from protos.duet.v1 import duet_pb2 as pb
from scripts.local_daemons import decode_node, prefill_node

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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        print("starting a prefill node and a decode node (NIXL over UCX shared memory) ...", flush=True)
        with prefill_node(Path(tmp)) as pn, \
                decode_node(Path(tmp), "--prefill", pn.address, "--min-remote-prefill-tokens", "16") as dn:
            print(f"prefill node {pn.address}, decode node {dn.address}: both healthy\n", flush=True)
            chat(dn)
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
