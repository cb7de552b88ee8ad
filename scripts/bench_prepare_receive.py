"""PrepareReceive latency through real gRPC: p50/p99 over 1,000 calls (goal p50 <= 2 ms), on an
idle decode node and on one decoding `--streams` streams, next to that node's decode step.

Each call reserves the window of a distinct 512-token prompt (no prefix hits) on a decode node
started for the purpose; every reservation is aborted right after, so the pool never fills.

The busy phase is why the engine has one lock rather than one owning thread (common/engine/core.py):
PrepareReceive takes the lock only for its bookkeeping, beside the running forward. An engine fed
by a command queue (vLLM's EngineCore) would answer it at the next step boundary, on average half
a decode step later; the step time printed beside it is that price.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from loadgen.percentiles import percentiles
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node


def _p50_p99(seconds: list[float]) -> tuple[float, float]:
    """Milliseconds."""
    p50, p99 = percentiles((1000 * x for x in seconds), [50, 99])
    return p50, p99


def _prepare_latencies(stub, rng: random.Random, calls: int, prompt_len: int, tag: str) -> list[float]:
    latencies = []
    for i in range(calls + 20):  # the first 20 warm up the channel
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        started = time.perf_counter()
        stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=f"{tag}{i}", token_ids=prompt), timeout=10)
        latencies.append(time.perf_counter() - started)
        stub.Abort(pb.AbortRequest(request_id=f"{tag}{i}"), timeout=10)
    return latencies[20:]


def _decode_streams(stub, rng: random.Random, streams: int, context: int, stop: threading.Event,
                    gaps: list[float], chunks: list[int]) -> list[threading.Thread]:
    """`streams` greedy streams of `context`-token prompts until `stop`; the gaps between the
    first stream's chunks (one decode step each) go to `gaps`, each stream's chunk count to
    `chunks`."""
    def run(i: int) -> None:
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        call = stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(
            max_tokens=100_000, ignore_eos=True)))
        last = None
        for _ in call:
            chunks[i] += 1
            now = time.perf_counter()
            if i == 0 and last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                call.cancel()
                return

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    return threads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--streams", type=int, default=8, help="decoding streams in the busy phase (0: skip it)")
    p.add_argument("--context", type=int, default=1000, help="prompt tokens of each stream")
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, decode_node(Path(tmp), "--kv-pages", "2048") as dn:
        p50, p99 = _p50_p99(_prepare_latencies(dn.stub, rng, args.calls, args.prompt_len, "idle"))
        print(f"PrepareReceive, {args.prompt_len}-token prompts, {args.calls} calls, idle node: p50 {p50:.2f} ms, "
              f"p99 {p99:.2f} ms (goal p50 <= 2 ms: {'PASS' if p50 <= 2 else 'MISS'})")
        if args.streams:
            stop, gaps, chunks = threading.Event(), [], [0] * args.streams
            threads = _decode_streams(dn.stub, rng, args.streams, args.context, stop, gaps, chunks)
            while min(chunks) < 5:  # every stream past its prefill: steps are decode steps
                time.sleep(0.1)
            gaps.clear()
            p50, p99 = _p50_p99(_prepare_latencies(dn.stub, rng, args.calls // 10, args.prompt_len, "busy"))
            while len(gaps) < 20:
                time.sleep(0.1)
            stop.set()
            for t in threads:
                t.join()
            step50, step99 = _p50_p99(gaps)
            print(f"  while {args.streams} streams of {args.context} tokens decode: p50 {p50:.2f} ms, p99 {p99:.2f} ms; "
                  f"decode step p50 {step50:.1f} ms, p99 {step99:.1f} ms: answering at the next step boundary "
                  f"instead would add about {step50 / 2:.1f} ms on average")
    return 0


if __name__ == "__main__":
    sys.exit(main())
