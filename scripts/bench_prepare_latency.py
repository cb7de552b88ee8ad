"""How long PrepareReceive waits on a busy decode node, next to one decode step.

The decode node's RPC threads take the engine lock for their bookkeeping while the scheduler's
forward runs without it (common/engine/core.py). An engine owned by its stepping thread, fed by a
command queue (vLLM's EngineCore), would instead answer PrepareReceive at the next step boundary:
on average half a step later, at worst a whole step. This prints both, side by side, for one
in-process decode node running `--streams` greedy streams (default model, default dtype).

Usage: python -m scripts.bench_prepare_latency [--streams 8] [--context 1000] [--calls 40]
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from common.engine.sampling import SamplingParams
from common.serving.model_loading import load_model_and_tokenizer
from decode_node.config import parse_args
from decode_node.node import DecodeNode


def _percentile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens of each stream")
    parser.add_argument("--calls", type=int, default=40, help="timed PrepareReceive calls")
    args = parser.parse_args()
    config = parse_args(["--kv-pages", "1024", "--transport", "tcp", "--port", "0"])
    node = DecodeNode(config, *load_model_and_tokenizer(config.model, config.torch_dtype, config.device))
    rng = random.Random(0)
    try:
        handles = [node.generate(f"s{i}", rng.choices(range(100, 40000), k=args.context),
                                 SamplingParams(max_tokens=100_000, ignore_eos=True))
                   for i in range(args.streams)]
        gaps: list[float] = []
        stop = threading.Event()

        def watch() -> None:  # the gaps between one stream's chunks: one decode step each
            last = None
            while not stop.is_set():
                if handles[0].next_chunk(timeout=1) is not None:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(10)  # past the streams' prefill
        waits = []
        for i in range(args.calls):
            started = time.perf_counter()
            node.prepare_receive(f"p{i}", rng.choices(range(100, 40000), k=200), None)
            waits.append(time.perf_counter() - started)
            node.abort(f"p{i}")
            time.sleep(rng.uniform(0.01, 0.05))
        stop.set()
        watcher.join()
    finally:
        node.shutdown()
    step = statistics.median(gaps)
    print(f"{args.streams} streams of {args.context} tokens: decode step p50 {1e3 * step:.1f} ms, "
          f"p99 {1e3 * _percentile(gaps, 0.99):.1f} ms")
    print(f"PrepareReceive (200 tokens) under the engine lock: p50 {1e3 * statistics.median(waits):.2f} ms, "
          f"p99 {1e3 * _percentile(waits, 0.99):.2f} ms")
    print(f"at the next step boundary instead (command queue): about {1e3 * step / 2:.1f} ms more on average, "
          f"up to {1e3 * step:.1f} ms")


if __name__ == "__main__":
    main()
