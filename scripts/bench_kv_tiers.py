"""Prefix KV beyond the pool: an agentic multi-turn workload whose live histories outgrow one
decode node's KV pool, run on a fresh node with the disk tier (`--kv-offload-dir`) and on one
without, printed side by side.

The workload is loadgen's `--dataset agentic`: `--num-users` conversations, each with a system
prompt of its own of `--history-len` tokens (an agent's tools and documents), `--turns` turns of
`--question-len` tokens, the next sent `--think-time` seconds (mean) after the answer. Users start
`--user-rate` per second. Reported per run (loadgen's table): TTFT, and the prompt tokens the node
served from its caches (`usage.cached_tokens`: pool or disk) against those it could have, the
history already seen (loadgen/cacheable.py); and from the tiered node's metrics where the prompt
tokens came from (`duet_prompt_tokens{source}`) and the read-back time.

Goals: cache-served / cacheable >= 0.8 with the tier against < 0.4 without; TTFT p50 with
the tier <= 0.5x without.

The defaults scale the target shape (64 conversations of 2,000 tokens on a 32,000-token pool) to
what a 2-core CPU prefills below saturation (about 800 prompt tokens/s): 32 conversations of
1,000 tokens, 0.25 starting per second, on 6,400 tokens. Past saturation both runs queue and TTFT
measures the queue (docs/bench/kv_tiers.md).

Usage: python -m scripts.bench_kv_tiers [--num-users 64 --history-len 2000 --kv-pages 2000] [--output-dir DIR]
"""
from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from loadgen import BenchmarkConfig, format_table, run_benchmark, write_json
from loadgen.runner import BenchmarkResult
from harness.local_daemons import decode_node

SOURCES = ("pool", "disk", "computed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_kv_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-users", type=int, default=32, help="conversations (default %(default)s)")
    p.add_argument("--history-len", type=int, default=1000, help="tokens of each user's own system prompt "
                   "(default %(default)s)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default %(default)s)")
    p.add_argument("--question-len", type=int, default=64, help="tokens per question (default %(default)s)")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer (default %(default)s)")
    p.add_argument("--think-time", type=float, default=20.0, help="mean seconds between an answer and the next "
                   "turn (default %(default)s)")
    p.add_argument("--user-rate", type=float, default=0.25, help="users starting per second, Poisson "
                   "(default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=400, help="the decode node's pool, in 16-token pages "
                   "(default %(default)s: 6,400 tokens, about half the live conversations' histories)")
    p.add_argument("--node-flags", default="", help="more decode node flags, space-separated (e.g. '--threads 1')")
    p.add_argument("--output-dir", type=Path, help="write both runs as loadgen JSON there")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def workload(args: argparse.Namespace, target: str, label: str) -> BenchmarkConfig:
    return BenchmarkConfig(target=target, dataset="agentic", num_users=args.num_users, turns=args.turns,
                           prefix_len=args.history_len, input_len=args.question_len, output_len=args.output_len,
                           think_time=args.think_time, request_rate=args.user_rate, seed=args.seed, label=label)


def run(tmp: Path, args: argparse.Namespace, tiered: bool) -> tuple[BenchmarkResult, dict[str, float]]:
    """One run on a fresh decode node; with `tiered`, its disk tier in a fresh directory."""
    flags = ["--kv-pages", str(args.kv_pages), *args.node_flags.split()]
    if tiered:
        flags += ["--kv-offload-dir", str(tmp / "tier")]
    with decode_node(tmp, *flags) as node:
        result = run_benchmark(workload(args, node.address, "disk tier" if tiered else "pool only"), progress=None)
        return result, _tier_figures(node.metrics_text())


def _tier_figures(text: str) -> dict[str, float]:
    """Prompt tokens by source, and the disk tier's read-backs, from a node's /metrics page."""
    def sample(pattern: str) -> float:
        match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    figures = {s: sample(rf'duet_prompt_tokens_total\{{source="{s}"\}}') for s in SOURCES}
    figures["read_seconds"] = sample(r'duet_kv_tier_read_seconds_sum\{tier="disk"\}')
    figures["read_backs"] = sample(r'duet_kv_tier_read_seconds_count\{tier="disk"\}')
    figures["read_bytes"] = sample(r'duet_kv_tier_transferred_bytes_total\{direction="read",tier="disk"\}')
    figures["written"] = sample(r'duet_kv_tier_pages_total\{direction="written",tier="disk"\}')
    figures["skipped"] = sample(r'duet_kv_tier_write_skipped_total\{tier="disk"\}')
    return figures


def cache_share(result: BenchmarkResult) -> float:
    s = result.summary
    return s.total_cached_tokens / s.total_cacheable_tokens if s.total_cacheable_tokens else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_kv_tiers_") as tmp:
        tiered, figures = run(Path(tmp), args, tiered=True)
        plain, plain_figures = run(Path(tmp), args, tiered=False)
    print(f"\n## agentic: {args.num_users} users x {args.turns} turns, {args.history_len}-token histories, "
          f"think {args.think_time}s, a pool of {args.kv_pages * 16} tokens")
    print(format_table(tiered, plain))
    for label, f in (("disk tier", figures), ("pool only", plain_figures)):
        total = sum(f[s] for s in SOURCES) or 1.0
        print(f"{label}: prompt tokens from " + ", ".join(f"{s} {f[s]:.0f} ({f[s] / total:.0%})" for s in SOURCES))
    if figures["read_backs"]:
        print(f"disk tier: {figures['read_backs']:.0f} read-backs, {figures['read_bytes'] / 2**20:.0f} MiB, "
              f"{1000 * figures['read_seconds'] / figures['read_backs']:.1f} ms each on average; "
              f"{figures['written']:.0f} pages written, {figures['skipped']:.0f} skipped")
    ttft = tiered.summary.ttft_ms.median / plain.summary.ttft_ms.median
    print(f"cache-served / cacheable prompt tokens: disk tier {cache_share(tiered):.2f}, pool only "
          f"{cache_share(plain):.2f}; TTFT p50 disk tier / pool only {ttft:.2f}x", flush=True)
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(args.output_dir / "kv_tiers.json", tiered, plain)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
