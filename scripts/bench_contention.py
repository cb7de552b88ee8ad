"""duet and vLLM, each at its default flags, under the conditions users have (`make bench`):
the host's cores are never all the server's.

Cases, each system alone on the host, the same workload and client:
- idle: nothing else runs (but the client);
- busy-1, busy-2: one or two busy-loop neighbours (`while True: pass`), the way another pod, a
  tokenizer pool or a metrics agent takes a core;
- aiperf: NVIDIA's aiperf as the client, its own processes on the same host (scripts/peer_aiperf.py);
- quota: the server in a cgroup allowed half the cores (a CPU limit: scripts/cpu_quota.py), where
  the machine lets this script make one (else the case prints why it was skipped).
Workload: chat-length prompts of 200 tokens, 32 output tokens (EOS ignored), concurrency 4, streamed,
through each system's OpenAI API; loadgen is the client but in the aiperf case. Each case draws
other prompts, so no case rides on another's prefix cache.

Prints out tok/s, TTFT p50, ITL p50/p99 per case, each system's ratio to its own idle case and
duet / vLLM; writes docs/bench/contention.json. Goals: with one neighbour duet keeps at
least 0.45x its idle out tok/s and at most 3x its idle ITL p99; under aiperf at least 1.0x vLLM.

Usage: python -m scripts.bench_contention [--systems duet,vllm] [--cases ...] [--requests N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common.model.default_model import default_model_path
from common.openai_http import served_model_name
from loadgen import BenchmarkConfig, run_benchmark
from scripts.cpu_quota import QuotaUnavailable, cpu_quota
from scripts.export_hf_model import export_hf_model
from harness.local_daemons import ROOT, decode_node, free_port
from scripts.peer_aiperf import AiperfUnavailable, AiperfWorkload, run_aiperf
from loadgen.text_table import text_table
from scripts.peer_report import ratio_text, value_text
from scripts.peer_vllm import PeerUnavailable, ensure_installed, vllm_server

SYSTEMS = ("duet", "vllm")
CASES = ("idle", "busy-1", "busy-2", "aiperf", "quota")
INPUT_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 200, 32, 4


@contextlib.contextmanager
def serving(system: str, model_dir: Path, tmp: Path) -> Iterator[str]:
    """The system's OpenAI base URL while it runs, at its default flags."""
    if system == "vllm":
        with vllm_server(model_dir, tmp / f"vllm-{time.monotonic_ns()}.log") as url:
            yield url
        return
    port = free_port()
    with decode_node(tmp, "--model", str(model_dir), "--openai-port", str(port)):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes that each spin on a core for as long as the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def loadgen_case(url: str, requests: int, seed: int) -> dict:
    config = BenchmarkConfig(target=url, num_requests=requests, input_len=INPUT_TOKENS, output_len=OUTPUT_TOKENS,
                             max_concurrency=CONCURRENCY, ignore_eos=True, seed=seed, endpoint="/v1/chat/completions")
    s = run_benchmark(config, progress=None).summary
    return {"completed": s.completed, "failed": s.failed, "output_tokens_per_s": s.output_throughput,
            "ttft_p50_ms": s.ttft_ms and s.ttft_ms.median, "itl_p50_ms": s.itl_ms and s.itl_ms.median,
            "itl_p99_ms": s.itl_ms and s.itl_ms.p99}


def warm_up(url: str) -> None:
    run_benchmark(BenchmarkConfig(target=url, num_requests=CONCURRENCY, input_len=INPUT_TOKENS, output_len=8,
                                  max_concurrency=CONCURRENCY, seed=99), progress=None)


def measure(system: str, case: str, url: str, model_dir: Path, tmp: Path, requests: int) -> dict:
    seed = CASES.index(case) + 1
    if case == "aiperf":
        workload = AiperfWorkload("contention", INPUT_TOKENS, OUTPUT_TOKENS, CONCURRENCY, requests)
        return run_aiperf(url, model_dir, workload, tmp / system)
    with busy_loops(int(case.removeprefix("busy-")) if case.startswith("busy-") else 0):
        return loadgen_case(url, requests, seed)


def run_system(system: str, cases: list[str], model_dir: Path, tmp: Path, requests: int) -> dict[str, dict]:
    """Every case of one system: one server for the unconfined cases, another started in the quota."""
    results: dict[str, dict] = {}
    open_cases = [c for c in cases if c != "quota"]
    if open_cases:
        with serving(system, model_dir, tmp) as url:
            warm_up(url)
            for case in open_cases:
                print(f"{system}: {case} ...", flush=True)
                results[case] = measure(system, case, url, model_dir, tmp, requests)
    if "quota" in cases:
        cpus = len(os.sched_getaffinity(0)) / 2
        try:
            with cpu_quota(cpus) as quota, contextlib.ExitStack() as server:
                with quota.joined():  # the server is born in the quota's cgroup, the client is not
                    url = server.enter_context(serving(system, model_dir, tmp))
                print(f"{system}: quota of {cpus:g} CPUs ({quota.directory}) ...", flush=True)
                warm_up(url)
                results["quota"] = loadgen_case(url, requests, CASES.index("quota") + 1)
        except QuotaUnavailable as exc:
            print(f"{system}: quota case skipped: {exc}", flush=True)
    return results


def format_table(results: dict[str, dict[str, dict]]) -> str:
    cols = (("output_tokens_per_s", "out tok/s"), ("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50"),
            ("itl_p99_ms", "ITL p99"))
    header = ["case", "system", "ok", *(title for _, title in cols), "tok/s vs idle", "ITL p99 vs idle"]
    rows = []
    cases = [c for c in CASES if any(c in r for r in results.values())]
    for case in cases:
        for system, by_case in results.items():
            r, idle = by_case.get(case), by_case.get("idle")
            if r is None:
                continue
            vs = (ratio_text(r["output_tokens_per_s"], idle["output_tokens_per_s"]),
                  ratio_text(r["itl_p99_ms"], idle["itl_p99_ms"])) if idle else ("n/a", "n/a")
            rows.append([case, system, f"{r['completed']}/{r['completed'] + r['failed']}",
                         *(value_text(r[k]) for k, _ in cols), *vs])
        duet, vllm = results.get("duet", {}).get(case), results.get("vllm", {}).get(case)
        if duet and vllm:
            rows.append(["", "duet / vLLM", "", *(ratio_text(duet[k], vllm[k]) for k, _ in cols)])
    lines = text_table(header, rows, "<<" + ">" * (len(header) - 2))
    lines.append(f"{INPUT_TOKENS}-token chat prompts, {OUTPUT_TOKENS} output tokens, concurrency {CONCURRENCY}; "
                 "ms for latencies; ratios below 1 are better for latencies, above 1 for throughput")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of %(default)s")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of %(default)s")
    p.add_argument("--requests", type=int, default=16, help="requests per case (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="run everything this many times, the systems' order "
                   "reversed every other round, and print each number's median (default %(default)s)")
    p.add_argument("--output-dir", type=Path, default=ROOT / "docs" / "bench",
                   help="where contention.json goes (default %(default)s)")
    a = p.parse_args(argv)
    systems, cases = [s for s in a.systems.split(",") if s], [c for c in a.cases.split(",") if c]
    if not systems or set(systems) - set(SYSTEMS) or not cases or set(cases) - set(CASES) or a.rounds < 1:
        p.error(f"--systems from {','.join(SYSTEMS)}, --cases from {','.join(CASES)}, --rounds >= 1")
    began = time.monotonic()
    rounds: list[dict[str, dict[str, dict]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_contention_") as tmp:
        tmp = Path(tmp)
        try:
            if "vllm" in systems:
                ensure_installed()
            model_dir = export_hf_model(tmp / served_model_name(default_model_path()))
            for system in systems:
                (tmp / system).mkdir()
            for n in range(a.rounds):
                order = systems if n % 2 == 0 else systems[::-1]
                rounds.append({system: run_system(system, [c for c in CASES if c in cases], model_dir, tmp,
                                                  a.requests) for system in order})
        except (PeerUnavailable, AiperfUnavailable) as exc:
            print(f"bench_contention: {exc}", file=sys.stderr)
            return 2
    results = medians(rounds)
    print(format_table(results) + (f"\nmedians of {a.rounds} rounds" if a.rounds > 1 else ""))
    a.output_dir.mkdir(parents=True, exist_ok=True)
    (a.output_dir / "contention.json").write_text(json.dumps({"medians": results, "rounds": rounds}, indent=1) + "\n")
    print(f"bench_contention: {time.monotonic() - began:.0f}s in all", flush=True)
    return 0 if all(r["failed"] == 0 for run in rounds for by_case in run.values() for r in by_case.values()) else 1


def medians(rounds: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """Each system's, case's and number's median over the rounds that ran it (failed counts summed)."""
    out: dict[str, dict[str, dict]] = {}
    for system in rounds[0]:
        for case in rounds[0][system]:
            runs = [run[system][case] for run in rounds if case in run.get(system, {})]
            out.setdefault(system, {})[case] = {
                key: sum(r[key] for r in runs) if key in ("completed", "failed") else
                statistics.median(r[key] for r in runs) if all(r[key] is not None for r in runs) else None
                for key in runs[0]}
    return out


if __name__ == "__main__":
    sys.exit(main())
