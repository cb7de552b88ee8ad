"""The parts of scripts/bench_contention.py that need no server: medians over rounds, the table's
ratios to each system's idle case and duet / vLLM, and a CPU quota where none can be made."""
from __future__ import annotations

from pathlib import Path

import pytest

from scripts import cpu_quota
from scripts.bench_contention import format_table, medians


def _run(tok_s: float, itl_p99: float, failed: int = 0) -> dict:
    return {"completed": 16 - failed, "failed": failed, "output_tokens_per_s": tok_s, "ttft_p50_ms": 300.0,
            "itl_p50_ms": 30.0, "itl_p99_ms": itl_p99}


def test_medians_over_rounds_and_ratios_to_idle_and_to_vllm() -> None:
    rounds = [{"duet": {"idle": _run(100.0, 100.0), "busy-1": _run(60.0, 150.0)},
               "vllm": {"idle": _run(80.0, 100.0), "busy-1": _run(80.0, 120.0)}},
              {"vllm": {"idle": _run(70.0, 110.0), "busy-1": _run(70.0, 130.0, failed=1)},
               "duet": {"idle": _run(90.0, 90.0), "busy-1": _run(50.0, 140.0)}},
              {"duet": {"idle": _run(110.0, 95.0), "busy-1": _run(55.0, 160.0)},
               "vllm": {"idle": _run(90.0, 90.0), "busy-1": _run(75.0, 125.0)}}]
    m = medians(rounds)
    assert m["duet"]["idle"]["output_tokens_per_s"] == 100.0 and m["duet"]["busy-1"]["itl_p99_ms"] == 150.0
    assert (m["vllm"]["busy-1"]["completed"], m["vllm"]["busy-1"]["failed"]) == (47, 1)
    lines = format_table(m).splitlines()
    busy = next(line.split() for line in lines if line.startswith("busy-1   duet"))
    assert busy[-2:] == ["0.55x", "1.58x"]  # out tok/s and ITL p99 against its own idle case
    ratio = lines[lines.index(next(line for line in lines if line.startswith("busy-1   vllm"))) + 1].split()
    assert ratio[3] == "0.73x"  # duet / vLLM out tok/s: 55 / 75


def test_a_quota_where_the_cgroup_file_system_is_missing_says_why(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", tmp_path / "no-cgroups")
    with pytest.raises(cpu_quota.QuotaUnavailable, match="cpu controller"):
        with cpu_quota.cpu_quota(1.0):
            pass
