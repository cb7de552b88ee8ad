"""python -m loadgen: benchmark a decode node, a router or an OpenAI-compatible server, and print /
save the results."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from loadgen.config import OPENAI_ENDPOINTS, SLO_METRICS, BenchmarkConfig, is_http_target
from loadgen.report import format_table, write_json
from loadgen.runner import BenchmarkResult, run_benchmark
from loadgen.traces import write_run_trace


def _slo(text: str) -> tuple[str, float]:
    name, sep, value = text.partition(":")
    try:
        if not sep or name not in SLO_METRICS or float(value) <= 0:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC in {', '.join(SLO_METRICS)}, "
                                         f"got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> tuple[BenchmarkConfig, argparse.Namespace]:
    d = BenchmarkConfig(target="")
    p = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Send a workload to duet.v1.DecodeNode/Generate or to any OpenAI-compatible HTTP server, "
        "stream every answer, and report throughput, TTFT / TPOT / ITL / E2E latency and goodput.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", metavar="HOST:PORT|http(s)://HOST:PORT",
                       help="a decode node or a router (duet gRPC), or an OpenAI-compatible server "
                       "(http:// or https://)")
    where.add_argument("--targets", metavar="HOST:PORT,HOST:PORT,...",
                       help="duet gRPC targets (e.g. two routers): requests go to the first; one whose target "
                       "becomes UNAVAILABLE goes on at the next with the tokens it has received (after the last, at the first "
                       "again: at most three rounds)")
    p.add_argument("--endpoint", choices=OPENAI_ENDPOINTS, default=None,
                   help="HTTP targets: the API to call (default /v1/completions); /v1/chat/completions sends every "
                   "prompt as a chat message, over gRPC too, so --compare runs the same requests")
    p.add_argument("--model", default=None,
                   help="HTTP targets: the model to ask for (default: the first id of /v1/models)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a .gguf file or Hugging Face directory whose tokenizer turns token-id prompts (random, "
                   "shared-prefix) into chat text for --endpoint /v1/chat/completions (default: the embedded model)")
    p.add_argument("--label", default="", help="the target run's name in tables, JSON and plots (default: its address)")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="(default %(default)s)")
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="requests per second, Poisson arrivals; inf = all at once (default %(default)s)")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the inter-arrival times (mean 1/rate): 1 = Poisson, <1 burstier, "
                   ">1 more regular (default %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    p.add_argument("--dataset", default=d.dataset, metavar="random|shared-prefix|conversations|agentic|PATH",
                   help="synthetic token-id prompts, shared-prefix groups, multi-turn conversations (--num-users, "
                   "--turns; --num-requests does not apply), agentic ones (conversations, each user with a system "
                   "prompt of its own), or a JSONL {\"prompt\": ...} / ShareGPT JSON file (default %(default)s)")
    p.add_argument("--input-len", type=int, default=d.input_len,
                   help="prompt tokens (random) or per-request suffix tokens (shared-prefix) (default %(default)s)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=d.range_ratio,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    p.add_argument("--num-prefix-groups", type=int, default=d.num_prefix_groups,
                   help="shared-prefix: distinct prefixes (default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="shared-prefix: tokens of each shared prefix (default %(default)s)")
    p.add_argument("--num-users", type=int, default=d.num_users,
                   help="conversations: users, all sharing one system prompt of --prefix-len tokens, each asking "
                   "--turns questions of --input-len tokens, the next when the previous answer ends (default "
                   "%(default)s)")
    p.add_argument("--turns", type=int, default=d.turns,
                   help="conversations and --multi-turn: turns per user (default %(default)s)")
    p.add_argument("--think-time", type=float, default=d.think_time, metavar="S",
                   help="conversations: mean seconds (exponentially drawn) between an answer and the user's next "
                   "turn (default %(default)s)")
    p.add_argument("--multi-turn", action="store_true",
                   help="replay a ShareGPT file's conversations turn by turn (up to --num-users of them) instead "
                   "of sending first turns")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the output length (default: on for synthetic datasets, off for files)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, lengths and arrivals (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request (default %(default)s)")
    p.add_argument("--goodput", nargs="+", type=_slo, default=[], metavar="METRIC:MS",
                   help=f"SLOs for goodput, METRIC in {', '.join(SLO_METRICS)}, e.g. ttft:500 tpot:50")
    p.add_argument("--compare", metavar="HOST:PORT|http(s)://HOST:PORT",
                   help="afterwards, run the same workload against this target and print both side by side")
    p.add_argument("--compare-label", default="", help="the --compare run's name (default: its address)")
    p.add_argument("--output", type=Path, metavar="FILE.json", help="write the summary and every request's timings")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="write latency CDFs and a request timeline")
    p.add_argument("--trace", type=Path, metavar="FILE.json",
                   help="afterwards, fetch the run's request traces (GetTrace) from --target and every --trace-from "
                   "node, merge them and write Chrome trace-event JSON (open in Perfetto)")
    p.add_argument("--trace-from", action="append", default=[], metavar="HOST:PORT",
                   help="another node to fetch --trace events from, e.g. a prefill node (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(argv)
    targets = a.targets.split(",") if a.targets else [a.target]
    if a.targets and (len(targets) < 2 or not all(targets) or any(is_http_target(t) for t in targets)):
        p.error(f"--targets {a.targets}: give two or more duet gRPC HOST:PORT, comma-separated")
    try:
        config = BenchmarkConfig(
            target=targets[0], fallbacks=tuple(targets[1:]), num_requests=a.num_requests,
            request_rate=a.request_rate, burstiness=a.burstiness,
            max_concurrency=a.max_concurrency, dataset=a.dataset, input_len=a.input_len, output_len=a.output_len,
            range_ratio=a.range_ratio, num_prefix_groups=a.num_prefix_groups, prefix_len=a.prefix_len,
            ignore_eos=a.ignore_eos, seed=a.seed, timeout=a.timeout, goodput=dict(a.goodput), label=a.label,
            endpoint=a.endpoint, model=a.model, tokenizer=a.tokenizer, num_users=a.num_users, turns=a.turns,
            multi_turn=a.multi_turn, think_time=a.think_time,
        )
    except ValueError as exc:
        p.error(str(exc))
    if a.trace and config.is_http:
        p.error("--trace fetches traces over duet's gRPC: give --target as HOST:PORT")
    if a.model and not any(is_http_target(t) for t in (config.target, a.compare or "")):
        p.error("--model applies to http(s):// targets only")
    return config, a


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when some run completed no request at all, else 0."""
    config, a = parse_args(argv)
    progress = None if a.no_progress else sys.stderr
    result = run_benchmark(config, progress)
    compare = None
    if a.compare:
        compare = run_benchmark(dataclasses.replace(config, target=a.compare, fallbacks=(), label=a.compare_label),
                                progress)
    print(format_table(result, compare), flush=True)
    if a.output:
        write_json(a.output, result, compare)
    if a.plot:
        from loadgen.plot import write_plot  # matplotlib is needed only for --plot

        write_plot(a.plot, result, compare)
    if a.trace:
        _write_trace(a.trace, [config.target, *a.trace_from], result)
    return 1 if any(r.summary.completed == 0 for r in (result, compare) if r is not None) else 0


def _write_trace(path: Path, addresses: list[str], result: BenchmarkResult) -> None:
    """The target run's traces (not --compare's); nodes that do not answer are reported on stderr."""
    collected = write_run_trace(path, addresses, [r.request_id for r in result.requests])
    for address, count in collected.events_by_node.items():
        print(f"trace: {count} events from {address}", file=sys.stderr)
    for address, why in collected.failures.items():
        print(f"trace: no events from {address}: {why}", file=sys.stderr)
    print(f"trace: wrote {len(collected.events)} events to {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
