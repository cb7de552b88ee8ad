"""`make bench-peer`'s results: one record per (workload, system), the side-by-side table with
duet / vLLM ratios, and a PNG of the same numbers."""
from __future__ import annotations

import json
from pathlib import Path

from loadgen.metrics import LatencyStats
from loadgen.runner import BenchmarkResult
from loadgen.text_table import text_table

PEER, PEER_NGRAM, PEER_FP32 = "vllm", "vllm-ngram", "vllm-fp32"
# vLLM's own prefill/decode disaggregation (scripts/peer_vllm_disagg.py): as it comes, where vLLM's
# NIXL worker re-pins a prefiller thread to the decoder's core, and with that re-pinning neutralised
PEER_DISAGG, PEER_DISAGG_BOUND = "vllm-disaggregated", "vllm-disaggregated-bound"
# systems run with n-gram speculative decoding -> the same system without it
SPECULATIVE = {PEER_NGRAM: PEER, "duet-ngram": "duet-colocated"}
# systems forced to float32 (the others run at their engine's default dtype: bf16 on this CPU)
FP32 = {PEER_FP32, "duet-fp32"}
# (record key, column title, higher is better)
COLUMNS = (
    ("ttft_p50_ms", "TTFT p50", False), ("ttft_p99_ms", "TTFT p99", False),
    ("itl_p50_ms", "ITL p50", False), ("itl_p99_ms", "ITL p99", False), ("tpot_p99_ms", "TPOT p99", False),
    ("output_tokens_per_s", "out tok/s", True), ("goodput_req_per_s", "goodput", True),
)


def is_peer(system: str) -> bool:
    return system in (PEER, PEER_NGRAM, PEER_FP32, PEER_DISAGG, PEER_DISAGG_BOUND)


def peer_of(system: str) -> str:
    """The vLLM system a system is compared with: vLLM with n-gram speculation for a speculating
    system, vLLM forced to float32 for a float32 one, plain vLLM (its default dtype) otherwise."""
    if system in SPECULATIVE:
        return PEER_NGRAM
    return PEER_FP32 if system in FP32 else PEER


def peers_of(system: str) -> tuple[str, ...]:
    """Every vLLM system a duet system's ratios are printed against: `peer_of`, and for the
    disaggregated pair also vLLM's own disaggregation in both pinnings."""
    if system == "duet-disaggregated":
        return PEER, PEER_DISAGG, PEER_DISAGG_BOUND
    return (peer_of(system),)


def record(workload: str, system: str, result: BenchmarkResult | dict, peer: BenchmarkResult | dict | None,
           acceptance_rate: float | None = None, dtype: str | None = None) -> dict:
    """The numbers of one run, loadgen's `result` or aiperf's numbers (scripts/peer_aiperf.py);
    `same_text_as_vllm` counts the requests whose greedy answer is its peer's (`peer_of`), word
    for word (None without a peer run or without the answers: aiperf's); `acceptance_rate` is
    accepted / drafted speculative tokens (None without speculation); `dtype` what the system
    computed in."""
    same = None
    if isinstance(result, BenchmarkResult) and isinstance(peer, BenchmarkResult) and not is_peer(system):
        same = sum(a.ok and b.ok and a.text == b.text for a, b in zip(result.requests, peer.requests))
    numbers = result if isinstance(result, dict) else loadgen_numbers(result)
    return {"workload": workload, "system": system, "dtype": dtype, **numbers, "same_text_as_vllm": same,
            "acceptance_rate": acceptance_rate}


def loadgen_numbers(result: BenchmarkResult) -> dict:
    """A loadgen run's numbers, under the names aiperf's are given too (scripts/peer_aiperf.py)."""
    s = result.summary

    def pick(stats: LatencyStats | None, name: str) -> float | None:
        return None if stats is None else getattr(stats, name)

    return {
        "model": result.model, "completed": s.completed, "failed": s.failed,
        "failed_by_status": s.failed_by_status, "duration_s": s.duration_s,
        "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
        "ttft_p50_ms": pick(s.ttft_ms, "median"), "ttft_p99_ms": pick(s.ttft_ms, "p99"),
        "itl_p50_ms": pick(s.itl_ms, "median"), "itl_p99_ms": pick(s.itl_ms, "p99"),
        "tpot_p99_ms": pick(s.tpot_ms, "p99"), "output_tokens_per_s": s.output_throughput,
        "goodput_req_per_s": s.goodput,
    }


def format_table(records: list[dict]) -> str:
    """Rows grouped by workload; under each duet row, its ratio to its vLLM row (`peer_of`) of that
    workload; then what speculation bought each system that speculates."""
    header = ["workload", "system", "ok/all", *(title for _, title, _ in COLUMNS)]
    table = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload]
        by_system = {r["system"]: r for r in rows}
        for i, r in enumerate(rows):
            done = f"{r['completed']}/{r['completed'] + r['failed']}"
            name = f"{r['system']} ({r['dtype']})" if r.get("dtype") else r["system"]
            table.append([workload if i == 0 else "", name, done, *(value_text(r[key]) for key, _, _ in COLUMNS)])
            peers = [] if is_peer(r["system"]) else [by_system[p] for p in peers_of(r["system"]) if p in by_system]
            for peer in peers:
                title = "  duet / vLLM" if peer["system"] == PEER else f"  duet / {peer['system']}"
                table.append(["", title, "", *(ratio_text(r[key], peer[key]) for key, _, _ in COLUMNS)])
    lines = text_table(header, table, "<<" + ">" * (len(header) - 2))
    lines.append(lines[1])  # the rule under the header closes the table too
    by_key = {(r["workload"], r["system"]): r for r in records}
    for r in records:
        plain = by_key.get((r["workload"], SPECULATIVE.get(r["system"])))
        if plain is not None:
            rate = r.get("acceptance_rate")
            lines.append(f"speculation, {r['workload']}: {r['system']} / {plain['system']} out tok/s = "
                         f"{ratio_text(r['output_tokens_per_s'], plain['output_tokens_per_s'])}, ITL p50 = "
                         f"{ratio_text(r['itl_p50_ms'], plain['itl_p50_ms'])}, drafted tokens accepted: "
                         + ("n/a" if rate is None else f"{rate:.0%}"))
    same = [f"{system} {sum(r['same_text_as_vllm'] for r in rows)}/{sum(r['completed'] for r in rows)}"
            for system in dict.fromkeys(r["system"] for r in records)
            if (rows := [r for r in records if r["system"] == system and r.get("same_text_as_vllm") is not None])]
    if same:
        lines.append("greedy answers word for word vLLM's: " + ", ".join(same))
    lines.append("ms for latencies; out tok/s = output tokens per second; goodput = requests per second meeting "
                 "the SLOs; ratios are duet / vLLM (below 1 is better for latencies, above 1 for throughput)")
    return "\n".join(lines)


def value_text(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def ratio_text(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def write_json(path: Path, records: list[dict]) -> None:
    path.write_text(json.dumps(records, indent=1, allow_nan=False) + "\n")


def write_plot(path: Path, records: list[dict], title: str) -> None:
    """One row per workload: TTFT, ITL (p50 solid, p99 hatched) and output tokens/s, a bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in records))
    systems = list(dict.fromkeys(r["system"] for r in records))
    colors = {system: plt.cm.tab10(i % 10) for i, system in enumerate(systems)}
    panels = (("TTFT (ms)", ("ttft_p50_ms", "ttft_p99_ms")), ("ITL (ms)", ("itl_p50_ms", "itl_p99_ms")),
              ("output tokens/s", ("output_tokens_per_s",)))
    fig, axes = plt.subplots(len(workloads), len(panels), figsize=(15, 3.2 * len(workloads)), squeeze=False,
                             layout="constrained")
    width = 0.8 / len(systems)
    for row, workload in enumerate(workloads):
        by_system = {r["system"]: r for r in records if r["workload"] == workload}
        for col, (name, keys) in enumerate(panels):
            ax = axes[row][col]
            for i, system in enumerate(systems):
                r = by_system.get(system)
                values = [(r or {}).get(key) or 0.0 for key in keys]
                xs = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(keys))]
                bars = ax.bar(xs, values, width, color=colors[system], label=system)
                for bar, key in zip(bars, keys):
                    if key.endswith("p99_ms"):
                        bar.set_hatch("//")
            ax.set_xticks(range(len(keys)), [k.split("_")[1] if k.endswith("_ms") else "" for k in keys])
            ax.set_title(f"{workload}: {name}")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
