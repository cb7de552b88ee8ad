"""Long-context serving on one host: a decode node alone, and a prefill
node plus a decode node started with default flags on the same cores (both see every core).

Workload: random-token prompts of `--input-len` tokens (default 1000), `--output-len` output
tokens (default 64, EOS ignored), `--concurrency` requests in flight (default 4), the same prompts
for every setup. Prints ITL p50/p99, TTFT p50 and output tokens/s per setup; `--json FILE` writes
them; `--profile DIR` writes where each daemon's threads spent their time. `--setups` picks
the setups, `pinned` being placement by hand (prefill node on core 0,
decode node on core 1, one thread each). `--node-flags` passes extra flags to both daemons.

Usage: python -m scripts.bench_colocated [--num-requests N] [--setups ...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from loadgen import BenchmarkConfig, run_benchmark
from loadgen.text_table import aligned_rows
from harness.local_daemons import decode_node, prefill_node

SETUPS = ("decode-alone", "prefill+decode", "pinned")


def measure(target: str, args: argparse.Namespace) -> dict[str, float]:
    config = BenchmarkConfig(target=target, num_requests=args.num_requests, max_concurrency=args.concurrency,
                             input_len=args.input_len, output_len=args.output_len, ignore_eos=True, seed=17)
    s = run_benchmark(config).summary
    return {"completed": s.completed, "failed": s.failed, "itl_p50_ms": s.itl_ms.median, "itl_p99_ms": s.itl_ms.p99,
            "ttft_p50_ms": s.ttft_ms.median, "output_tokens_per_s": s.output_throughput}


def run_setup(name: str, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    flags = shlex.split(args.node_flags)
    profiles = {node: None if args.profile is None else args.profile / f"{name}.{node}.json"
                for node in ("prefill", "decode")}
    with ExitStack() as stack:
        if name == "decode-alone":
            dn = stack.enter_context(decode_node(tmp, *flags, profile=profiles["decode"]))
        elif name == "prefill+decode":
            pn = stack.enter_context(prefill_node(tmp, *flags, profile=profiles["prefill"]))
            dn = stack.enter_context(decode_node(tmp, "--prefill", pn.address, *flags, profile=profiles["decode"]))
        else:  # pinned by hand: prefill node on core 0, decode node on core 1
            pn = stack.enter_context(prefill_node(tmp, "--threads", "1", *flags, cpus={0}, profile=profiles["prefill"]))
            dn = stack.enter_context(decode_node(tmp, "--threads", "1", "--prefill", pn.address, *flags, cpus={1},
                                                 profile=profiles["decode"]))
        return measure(dn.address, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS[:2]),
                   help="what to run (default: %(default)s); pinned = prefill node on core 0, decode node on "
                   "core 1, one thread each")
    p.add_argument("--node-flags", default="", help="extra flags for both daemons, one shell-quoted string")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    p.add_argument("--profile", type=Path, metavar="DIR", help="write each daemon's thread profile here "
                   "(SETUP.NODE.json, scripts/stack_sampler.py)")
    args = p.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups:
            print(f"{name} ...", flush=True)
            results[name] = run_setup(name, Path(tmp), args)
    print(f"\n{args.input_len}/{args.output_len} tokens, concurrency {args.concurrency}, {args.num_requests} requests")
    table = [[name, f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}", f"{r['ttft_p50_ms']:.0f}",
              f"{r['output_tokens_per_s']:.2f}", str(r["failed"])] for name, r in results.items()]
    header = ["setup", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "out tok/s", "failed"]
    print("\n".join(aligned_rows([header, *table], "<>>>>>")))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
