"""Aggregate statistics of a run: throughput, latency percentiles, goodput."""
from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.percentiles import percentiles
from loadgen.request_result import RequestResult


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats | None:
        if not seconds:
            return None
        ms = [1000.0 * s for s in seconds]
        p50, p90, p99 = percentiles(ms, [50, 90, 99])
        return cls(mean=statistics.fmean(ms), median=p50, p90=p90, p99=p99)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    failed_by_status: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    total_cacheable_tokens: int | None  # conversation workloads: what a prefix cache could have served
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # completed requests meeting every SLO / s; None without SLOs
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2el_ms: LatencyStats | None


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A request meets an SLO it has no value for (TPOT of a one-token answer)."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(values[name] is None or values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(results: Sequence[RequestResult], duration_s: float, slos_ms: dict[str, float]) -> Summary:
    """Token counts and latencies come from successful requests only; failures are counted by status."""
    ok = [r for r in results if r.ok]
    failed = Counter(r.status for r in results if not r.ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        completed=len(ok),
        failed=sum(failed.values()),
        failed_by_status=dict(failed.most_common()),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        total_cacheable_tokens=None if any(r.cacheable_tokens is None for r in ok)
        else sum(r.cacheable_tokens for r in ok),
        request_throughput=len(ok) * per_second,
        output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        goodput=sum(meets_slos(r, slos_ms) for r in ok) * per_second if slos_ms else None,
        ttft_ms=LatencyStats.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=LatencyStats.of([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=LatencyStats.of([gap for r in ok for gap in r.itl]),
        e2el_ms=LatencyStats.of([r.e2el for r in ok]),
    )
