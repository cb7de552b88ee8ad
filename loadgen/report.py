"""The printed results table (one target, or two side by side) and the JSON file."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from loadgen.metrics import LatencyStats, Summary
from loadgen.request_result import RequestResult
from loadgen.runner import BenchmarkResult
from loadgen.text_table import aligned_rows

LATENCIES = (  # (Summary field, short name, section title)
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)
Row = tuple[str, list[float | int | None]]  # label, one value per run; a section title has no values


def format_table(result: BenchmarkResult, compare: BenchmarkResult | None = None) -> str:
    """vllm-bench-serve-style table; with `compare`, columns target | compare | ratio (target/compare),
    headed by the runs' labels ("target" and "compare" when unlabelled)."""
    runs = [result] if compare is None else [result, compare]
    addresses = [run.config.target for run in runs]
    names = [run.config.label or role for run, role in zip(runs, ("target", "compare"))]
    rows = _rows([run.summary for run in runs])
    if compare is None:
        title, align = " Serving Benchmark Result ", "<>"
        head = [*([["Label:", result.config.label]] if result.config.label else []), ["Target:", addresses[0]]]
        values = [[f"{label}:", _cell(v[0])] for label, v in rows if v]
    else:
        title, align = " Serving Benchmark Comparison ", "<>>>"
        head = [["metric", *names, "ratio"], ["address", *addresses, "(tgt/cmp)"]]
        values = [[label, _cell(v[0]), _cell(v[1]), _ratio(*v)] for label, v in rows if v]
    aligned = aligned_rows([*head, *values], align)
    width = max(map(len, aligned))
    lines = [title.center(width, "="), *aligned[:len(head)]]
    value_lines = iter(aligned[len(head):])
    lines += [next(value_lines) if v else f" {label} ".center(width, "-") for label, v in rows]
    examples = [(f"{name}: " if compare is not None else "") + line
                for name, run in zip(names, runs) for line in _error_examples(run.requests)]
    if examples:
        lines += [" Errors (one example per status) ".center(width, "-"), *examples]
    return "\n".join(lines + ["=" * width])


def _rows(summaries: list[Summary]) -> list[Row]:
    def each(get) -> list[float | int | None]:
        return [get(s) for s in summaries]

    statuses = sorted({status for s in summaries for status in s.failed_by_status})
    rows: list[Row] = [
        ("Successful requests", each(lambda s: s.completed)),
        ("Failed requests", each(lambda s: s.failed)),
        *[(f"  {status}", each(lambda s, st=status: s.failed_by_status.get(st, 0))) for status in statuses],
        ("Benchmark duration (s)", each(lambda s: s.duration_s)),
        ("Total input tokens", each(lambda s: s.total_input_tokens)),
        ("Total generated tokens", each(lambda s: s.total_output_tokens)),
        ("Cached prompt tokens", each(lambda s: s.total_cached_tokens)),
        *([("Cacheable prompt tokens", each(lambda s: s.total_cacheable_tokens)),
           ("Cached / cacheable", each(_cache_share))] if summaries[0].total_cacheable_tokens is not None else []),
        ("Request throughput (req/s)", each(lambda s: s.request_throughput)),
        ("Output token throughput (tok/s)", each(lambda s: s.output_throughput)),
        ("Total token throughput (tok/s)", each(lambda s: s.total_token_throughput)),
    ]
    if summaries[0].goodput is not None:
        rows.append(("Goodput (req/s)", each(lambda s: s.goodput)))
    for field_name, short, title in LATENCIES:
        rows.append((title, []))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            rows.append((f"{name} {short} (ms)", each(lambda s, f=field_name, st=stat: _stat(getattr(s, f), st))))
    return rows


def _cache_share(s: Summary) -> float | None:
    return s.total_cached_tokens / s.total_cacheable_tokens if s.total_cacheable_tokens else None


def _stat(stats: LatencyStats | None, name: str) -> float | None:
    return None if stats is None else getattr(stats, name)


def _cell(value: float | int | None) -> str:
    return "n/a" if value is None else str(value) if isinstance(value, int) else f"{value:.2f}"


def _ratio(target: float | int | None, compare: float | int | None) -> str:
    if target is None or compare is None or compare == 0:
        return "n/a"
    return f"{target / compare:.2f}x"


def _error_examples(requests: list[RequestResult]) -> list[str]:
    """One error message per failure status, so a failed run says why."""
    seen: dict[str, str] = {}
    for r in requests:
        if not r.ok and r.status not in seen:
            seen[r.status] = r.error
    return [f"{status}: {error[:200]}" for status, error in seen.items()]


def result_to_dict(result: BenchmarkResult) -> dict:
    config = asdict(result.config)
    if math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"  # JSON has no infinity
    config["ignore_eos"] = result.config.effective_ignore_eos
    return {
        "label": result.config.name,
        "target": result.config.target,
        "model": result.model,
        "started_unix": result.started_unix,
        "config": config,
        "summary": asdict(result.summary),
        "requests": [_request_to_dict(r) for r in result.requests],
    }


def _request_to_dict(r: RequestResult) -> dict:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0

    return {
        "index": r.index,
        "request_id": r.request_id,
        "status": r.status,
        "error": r.error,
        "finish_reason": r.finish_reason,
        "arrival_s": r.arrival,
        "start_s": r.start,
        "first_token_s": r.first_token,
        "end_s": r.end,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2el_ms": ms(r.e2el),
        "itl_ms": [ms(gap) for gap in r.itl],
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "cacheable_tokens": r.cacheable_tokens,
        "retries": r.retries,
        "text": r.text,
    }


def write_json(path: Path, result: BenchmarkResult, compare: BenchmarkResult | None = None) -> None:
    """The target's run at the top level; the --compare run, when there is one, under "compare"."""
    data = result_to_dict(result)
    if compare is not None:
        data["compare"] = result_to_dict(compare)
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
