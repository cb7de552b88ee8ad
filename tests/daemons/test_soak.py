"""A bounded soak at saturation through loadgen: nothing admitted fails, nothing grows.

Also: under overload (more requests than `--max-requests`) the decode node refuses the excess
at once with RESOURCE_EXHAUSTED instead of queuing without bound.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loadgen import BenchmarkConfig, run_benchmark
from harness.helpers import started_pair


def footprint(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, threads, open fds) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def back_to_baseline(d) -> bool:
    m = d.metrics()
    return m["duet_kv_pages_free"] + m["duet_kv_pages_cached"] == m["duet_kv_pages_total"] and \
        m.get("duet_kv_pages_reserved", 0) == 0


@pytest.mark.slow
def test_soak_at_saturation_leaks_nothing(tmp_path):
    with started_pair(tmp_path, (), ("--min-remote-prefill-tokens", "32", "--max-requests", "12")) as (dn, pn):
        def round_(seed: int):
            config = BenchmarkConfig(target=dn.address, num_requests=16, request_rate=float("inf"), input_len=96,
                                     output_len=8, range_ratio=0.5, seed=seed, timeout=120)
            return run_benchmark(config, progress=None)

        round_(0)  # warm-up: caches, pools, thread pools reach their working size
        before = {d: footprint(d.proc.pid) for d in (dn, pn)}
        results = [round_(seed) for seed in (1, 2)]
        for result in results:
            statuses = {r.status for r in result.requests}
            assert statuses <= {"OK", "RESOURCE_EXHAUSTED"}, statuses  # refused at admission, never failed later
            assert result.summary.completed >= 12
        refused = [r for result in results for r in result.requests if r.status == "RESOURCE_EXHAUSTED"]
        assert refused and all(r.e2el < 1.0 for r in refused)  # refused at once, not after queuing
        deadline = time.monotonic() + 30
        while not (back_to_baseline(dn) and back_to_baseline(pn)):
            assert time.monotonic() < deadline, (dn.metrics(), pn.metrics())
            time.sleep(0.2)
        for d, (rss, threads, fds) in before.items():
            rss2, threads2, fds2 = footprint(d.proc.pid)
            assert rss2 < rss * 1.15 + 50e6, (d.log_path.name, rss, rss2)
            # gRPC's executor starts workers lazily (up to its 64) as concurrency peaks, hence some slack.
            assert threads2 <= threads + 10 and fds2 <= fds + 4, (d.log_path.name, threads, threads2, fds, fds2)
