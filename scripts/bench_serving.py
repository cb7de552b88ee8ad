"""`make bench` (serving part): disaggregated vs colocated on one 2-core machine, same workload.

- colocated: one decode node, no prefill node, both cores, chunked prefill mixed into decode steps;
- disaggregated: a prefill node pinned to core 0 and a decode node pinned to core 1 (one torch
  thread each); the decode node hands prompts longer than 64 tokens to the prefill node.

The workload mixes long prompts (which stall a colocated decode batch while they prefill) with
short chat-like ones. Both runs get identical prompts and arrival times; loadgen prints them
side by side with ratios, and the JSON and PNG land under docs/ when --output-dir is given.
Goals: p99 TPOT disaggregated <= 0.3x colocated; goodput at the SLO >= 2x colocated.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from common.model.default_model import default_model_path
from common.model.tokenizer import load_tokenizer
from loadgen import BenchmarkConfig, format_table, run_benchmark, write_json
from loadgen.plot import write_plot
from harness.local_daemons import decode_node, prefill_node

SLO_MS = {"ttft": 10_000.0, "tpot": 200.0}


def mixed_prompts(path: Path, n: int, long_tokens: int, short_tokens: int, long_every: int, seed: int) -> None:
    """A JSONL of distinct text prompts: every `long_every`-th one long, the rest short."""
    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            length = long_tokens if i % long_every == 0 else short_tokens
            text = tokenizer.decode([rng.randrange(1000, 40000) for _ in range(length)], skip_special_tokens=True)
            f.write(json.dumps({"prompt": text}) + "\n")


@contextmanager
def disaggregated(tmp: Path, *args: str, decode_args: tuple[str, ...] = ()):
    """A prefill node pinned to core 0 and a decode node pinned to core 1, one torch thread each,
    the decode node handing prompts of 64 tokens or more to the prefill node; yields the decode
    node. `args` go to both daemons, `decode_args` to the decode node only."""
    with prefill_node(tmp, "--threads", "1", *args, cpus={0}) as pn, \
            decode_node(tmp, "--threads", "1", *args, "--prefill", pn.address, "--min-remote-prefill-tokens", "64",
                        *decode_args, cpus={1}) as dn:
        yield dn


def colocated(tmp: Path, *args: str):
    """One decode node at its default placement (compute threads adaptive, up to every core), no
    prefill node."""
    return decode_node(tmp, *args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=1200)
    p.add_argument("--output-dir", type=Path, help="write bench_serving.json and bench_serving.png here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dataset = tmp / "mixed.jsonl"
        mixed_prompts(dataset, args.num_requests, args.long_tokens, 48, long_every=4, seed=3)
        config = dict(num_requests=args.num_requests, request_rate=args.request_rate, dataset=str(dataset),
                      output_len=args.output_len, ignore_eos=True, seed=3, goodput=SLO_MS)
        print("disaggregated: prefill node on core 0, decode node on core 1 ...", flush=True)
        with disaggregated(tmp) as dn:
            disagg = run_benchmark(BenchmarkConfig(target=dn.address, label="disaggregated", **config))
        print("colocated: one decode node on both cores ...", flush=True)
        with colocated(tmp) as dn:
            coloc = run_benchmark(BenchmarkConfig(target=dn.address, label="colocated", **config))
    print(format_table(disagg, coloc))
    tpot = disagg.summary.tpot_ms.p99 / coloc.summary.tpot_ms.p99
    goodput = disagg.summary.goodput / coloc.summary.goodput if coloc.summary.goodput else float("inf")
    print(f"p99 TPOT disaggregated/colocated: {tpot:.2f}x (goal <= 0.3x: {'PASS' if tpot <= 0.3 else 'MISS'})")
    print(f"goodput at ttft<={SLO_MS['ttft']:.0f}ms tpot<={SLO_MS['tpot']:.0f}ms disaggregated/colocated: "
          f"{goodput:.2f}x (goal >= 2x: {'PASS' if goodput >= 2 else 'MISS'})")
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(args.output_dir / "bench_serving.json", disagg, coloc)
        write_plot(args.output_dir / "bench_serving.png", disagg, coloc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
