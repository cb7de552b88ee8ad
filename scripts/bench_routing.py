"""Prefix-aware vs load-only routing: two decode nodes and one prefill node behind the router, a
multi-turn conversation workload (loadgen `--dataset conversations`), the same workload once per
routing mode, each on freshly started daemons (cold caches), printed side by side.

Two scenarios:

- ``concurrent``: `--num-users` users starting `--user-rate` per second, each sending its next
  turn as the previous answer ends. Least-loaded routing tends to keep such closed-loop users on
  their node anyway (a turn that ends frees a slot on the very node its next turn then picks), so
  here the difference is mostly where the prompt is prefilled.
- ``serial``: `--serial-users` conversations, one request in flight at a time (the users' turns
  interleaved): an idle pair of nodes, where load routing takes the nodes in turn and a
  conversation's next turn usually lands on the node without its history (a cached share of
  about 0.73 under load routing).

Reported per mode (loadgen's table): TTFT, output tokens/s, prompt tokens the decode nodes served
from their prefix caches (`usage.cached_tokens`) against those a cache could have served. Both
modes prefill locally below `--min-remote-prefill-tokens` uncached tokens; only prefix routing
knows, before reserving, how much of a prompt its decode node holds, so under load routing every
long prompt goes to the prefill node even when the decode node holds most of it. With `--restart`
(on by default), a last run routes the concurrent scenario by prefix while one decode node is
restarted (SIGTERM, then started again on the same port) in the middle, and counts its failures.

Goals: prefix routing serves >= 0.9x of the cacheable prompt tokens from cache, its TTFT p50
is <= 0.6x load routing's, and no request fails across the restart.

Usage: python -m scripts.bench_routing [--scenarios concurrent,serial] [--no-restart] [--output-dir DIR]
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from loadgen import BenchmarkConfig, format_table, run_benchmark, write_json
from loadgen.runner import BenchmarkResult
from harness.local_daemons import decode_node, prefill_node, router

DRAIN_SECONDS = 120  # a restart lets every running stream finish (a request here takes up to ~20 s)
NODE_FLAGS = ("--threads", "1", "--transport", "tcp", "--drain-seconds", str(DRAIN_SECONDS))
SCENARIOS = ("concurrent", "serial")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--num-users", type=int, default=8, help="concurrent: conversations (default %(default)s)")
    p.add_argument("--user-rate", type=float, default=2.0,
                   help="concurrent: users starting per second, Poisson; inf = all at once (default %(default)s)")
    p.add_argument("--serial-users", type=int, default=7, help="serial: conversations (default %(default)s)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default %(default)s)")
    p.add_argument("--system-len", type=int, default=256, help="tokens of the shared system prompt (default %(default)s)")
    p.add_argument("--question-len", type=int, default=96, help="tokens per question (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="question lengths uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer (default %(default)s)")
    p.add_argument("--load-weight", type=float, default=None, help="--load-weight of router and decode nodes "
                   "(default: theirs)")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=128,
                   help="router and decode nodes: prefill locally below this many uncached prompt tokens, so a turn "
                   "whose history the decode node holds skips the prefill node (default %(default)s)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the concurrent scenario by prefix with a decode node restarted mid-run (default on)")
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds into that run (default %(default)s)")
    p.add_argument("--output-dir", type=Path, help="write each scenario's prefix and load runs as loadgen JSON there")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        p.error(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    return args


def workload(args: argparse.Namespace, scenario: str, target: str, label: str) -> BenchmarkConfig:
    serial = scenario == "serial"
    return BenchmarkConfig(
        target=target, dataset="conversations", num_users=args.serial_users if serial else args.num_users,
        turns=args.turns, prefix_len=args.system_len, input_len=args.question_len, output_len=args.output_len,
        range_ratio=args.range_ratio, request_rate=math.inf if serial else args.user_rate,
        max_concurrency=1 if serial else None, seed=args.seed, label=label)


def run_mode(tmp: Path, args: argparse.Namespace, scenario: str, mode: str,
             restart_after: float | None = None) -> BenchmarkResult:
    """One run on fresh daemons: a prefill node, two decode nodes, a router with `--routing mode`."""
    shared = ("--routing", mode, "--min-remote-prefill-tokens", str(args.min_remote_prefill_tokens))
    if args.load_weight is not None:
        shared += ("--load-weight", str(args.load_weight))
    with ExitStack() as stack:
        pf = stack.enter_context(prefill_node(tmp, *NODE_FLAGS))
        decode_flags = (*NODE_FLAGS, "--prefill", pf.address, *shared)
        decodes = [stack.enter_context(decode_node(tmp, *decode_flags)) for _ in range(2)]
        members = [a for d in decodes for a in ("--decode", d.address)]
        rt = stack.enter_context(router(tmp, *members, "--prefill", pf.address, *shared, "--poll-seconds", "0.25"))
        config = workload(args, scenario, rt.address, mode if restart_after is None else f"{mode}+restart")
        restarter = None
        if restart_after is not None:
            restarter = threading.Thread(target=_restart, args=(stack, tmp, decodes[1], decode_flags, restart_after))
            restarter.start()
        result = run_benchmark(config, progress=None)
        if restarter is not None:
            restarter.join()
        return result


def _restart(stack: ExitStack, tmp: Path, node, flags: tuple[str, ...], after: float) -> None:
    time.sleep(after)
    node.stop(signal.SIGTERM, timeout=DRAIN_SECONDS + 30)  # drains; new requests go to the other node
    stack.enter_context(decode_node(tmp, *flags, port=node.port))
    print(f"restarted the decode node at {node.address} {after:.0f}s into the run", file=sys.stderr)


def share(result: BenchmarkResult) -> str:
    s = result.summary
    ratio = s.total_cached_tokens / s.total_cacheable_tokens if s.total_cacheable_tokens else float("nan")
    return f"{s.total_cached_tokens}/{s.total_cacheable_tokens} = {ratio:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmp:
        for scenario in args.scenarios:
            prefix = run_mode(Path(tmp), args, scenario, "prefix")
            load = run_mode(Path(tmp), args, scenario, "load")
            described = workload(args, scenario, "", "")
            print(f"\n## {scenario}: {described.num_users} users x {args.turns} turns, "
                  f"{'one request at a time' if scenario == 'serial' else f'{args.user_rate} users/s'}")
            print(format_table(prefix, load))
            ttft = prefix.summary.ttft_ms.median / load.summary.ttft_ms.median
            print(f"{scenario}: cache-served / cacheable prompt tokens: prefix {share(prefix)}, load {share(load)}; "
                  f"TTFT p50 prefix / load {ttft:.2f}x", flush=True)
            if args.output_dir:
                args.output_dir.mkdir(parents=True, exist_ok=True)
                write_json(args.output_dir / f"routing_{scenario}.json", prefix, load)
        if args.restart:
            again = run_mode(Path(tmp), args, "concurrent", "prefix", restart_after=args.restart_after)
            s = again.summary
            print(f"concurrent, prefix routing, a decode node restarted mid-run: {s.completed} completed, "
                  f"{s.failed} failed {s.failed_by_status or ''}, cache-served {share(again)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
