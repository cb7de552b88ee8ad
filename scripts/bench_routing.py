"""Prefix-aware vs load-only routing: two decode nodes and one prefill node behind the router, a
multi-turn conversation workload (loadgen `--dataset conversations`), the same workload once per
routing mode, each on freshly started daemons (cold caches), printed side by side.

Reported per mode (loadgen's table): TTFT, output tokens/s, prompt tokens the decode nodes served
from their prefix caches (`usage.cached_tokens`) against those a cache could have served. Both
modes prefill locally below `--min-remote-prefill-tokens` uncached tokens; only prefix routing
knows, before reserving, how much of a prompt its decode node holds, so under load routing every
long prompt goes to the prefill node even when the decode node holds most of it. With
`--restart` (on by default), a third run routes by prefix while one decode node is restarted
(SIGTERM, then started again on the same port) in the middle of the run, and counts its failures.

Goals (#29): prefix routing serves >= 0.9x of the cacheable prompt tokens from cache, its TTFT p50
is <= 0.6x load routing's, and no request fails across the restart.

Usage: python -m scripts.bench_routing [--num-users 8] [--turns 3] [--output FILE.json]
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from loadgen import BenchmarkConfig, format_table, run_benchmark, write_json
from loadgen.runner import BenchmarkResult
from scripts.local_daemons import decode_node, prefill_node, router

NODE_FLAGS = ("--threads", "1", "--transport", "tcp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-users", type=int, default=8, help="concurrent conversations (default %(default)s)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default %(default)s)")
    p.add_argument("--system-len", type=int, default=256, help="tokens of the shared system prompt (default %(default)s)")
    p.add_argument("--question-len", type=int, default=96, help="tokens per question (default %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="question lengths uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    p.add_argument("--user-rate", type=float, default=2.0,
                   help="users starting per second, Poisson; inf = all at once (default %(default)s). Uneven "
                   "questions and starts keep the users' turns from falling into lockstep, where even load "
                   "routing would keep each conversation on one node")
    p.add_argument("--load-weight", type=float, default=None, help="the router's --load-weight (default: its own)")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=128,
                   help="router and decode nodes: prefill locally below this many uncached prompt tokens, so a turn "
                   "whose history the decode node holds skips the prefill node (default %(default)s)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="also run prefix routing with a decode node restarted mid-run (default on)")
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds into that run (default %(default)s)")
    p.add_argument("--output", type=Path, metavar="FILE.json", help="write prefix and load runs (loadgen's JSON)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run_mode(tmp: Path, args: argparse.Namespace, mode: str, restart_after: float | None = None) -> BenchmarkResult:
    """One run on fresh daemons: a prefill node, two decode nodes, a router with `--routing mode`."""
    shared = ("--min-remote-prefill-tokens", str(args.min_remote_prefill_tokens))  # router and decode nodes alike
    if args.load_weight is not None:
        shared += ("--load-weight", str(args.load_weight))
    with ExitStack() as stack:
        pf = stack.enter_context(prefill_node(tmp, *NODE_FLAGS))
        decode_flags = (*NODE_FLAGS, "--prefill", pf.address, "--routing", mode, *shared)
        decodes = [stack.enter_context(decode_node(tmp, *decode_flags)) for _ in range(2)]
        members = [a for d in decodes for a in ("--decode", d.address)]
        rt = stack.enter_context(router(tmp, *members, "--prefill", pf.address, "--routing", mode, *shared,
                                        "--poll-seconds", "0.25"))
        config = BenchmarkConfig(target=rt.address, dataset="conversations", num_users=args.num_users,
                                 turns=args.turns, prefix_len=args.system_len, input_len=args.question_len,
                                 output_len=args.output_len, range_ratio=args.range_ratio,
                                 request_rate=args.user_rate, seed=args.seed, label=mode if restart_after is None
                                 else f"{mode}+restart")
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
    node.stop(signal.SIGTERM)  # drains its streams; the router sends new requests to the other node
    stack.enter_context(decode_node(tmp, *flags, port=node.port))
    print(f"restarted the decode node at {node.address} {after:.0f}s into the run", file=sys.stderr)


def share(result: BenchmarkResult) -> str:
    s = result.summary
    ratio = s.total_cached_tokens / s.total_cacheable_tokens if s.total_cacheable_tokens else float("nan")
    return f"{s.total_cached_tokens}/{s.total_cacheable_tokens} = {ratio:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmp:
        prefix = run_mode(Path(tmp), args, "prefix")
        load = run_mode(Path(tmp), args, "load")
        print(format_table(prefix, load))
        ttft = prefix.summary.ttft_ms.median / load.summary.ttft_ms.median
        print(f"cache-served / cacheable prompt tokens: prefix {share(prefix)}, load {share(load)}")
        print(f"TTFT p50 prefix / load: {ttft:.2f}x")
        if args.output:
            write_json(args.output, prefix, load)
        if args.restart:
            again = run_mode(Path(tmp), args, "prefix", restart_after=args.restart_after)
            s = again.summary
            print(f"prefix routing, a decode node restarted mid-run: {s.completed} completed, {s.failed} failed "
                  f"{s.failed_by_status or ''}, cache-served {share(again)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
