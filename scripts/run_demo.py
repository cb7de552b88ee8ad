"""`make run`: start the daemons on localhost with the embedded model, send real requests,
print what came back, stop the daemons cleanly."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from protos.duet.v1 import duet_pb2 as pb
from tests.daemons import decode_node

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain what a KV cache is in one sentence.",
]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        print("starting the decode node (single-node mode) ...", flush=True)
        with decode_node(Path(tmp)) as node:
            print(f"decode node healthy at {node.address}\n")
            for question in QUESTIONS:
                request = pb.GenerateRequest(
                    messages=[pb.ChatMessage(role="user", content=question)],
                    sampling=pb.SamplingParams(max_tokens=96, temperature=0.0),
                )
                started = time.perf_counter()
                first = None
                print(f"user> {question}\nassistant> ", end="", flush=True)
                for chunk in node.stub.Generate(request):
                    first = first or time.perf_counter()
                    print(chunk.text, end="", flush=True)
                    last = chunk
                elapsed = time.perf_counter() - started
                u = last.usage
                print(f"\n  [{u.completion_tokens} tokens, prompt {u.prompt_tokens} ({u.cached_tokens} cached), "
                      f"TTFT {1000 * (first - started):.0f} ms, {u.completion_tokens / elapsed:.1f} tok/s, "
                      f"finish={last.finish_reason}]\n", flush=True)
            metrics = node.metrics()
            print(f"KV pages: {metrics['duet_kv_pages_free']:.0f} free, {metrics['duet_kv_pages_cached']:.0f} "
                  f"cached, {metrics['duet_kv_pages_total']:.0f} total")
        print("daemons stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
