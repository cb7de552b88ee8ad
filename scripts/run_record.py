"""What every benchmark record names beside its numbers: the machine and the commit that made them."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CPU flags that choose duet's kernels and dtype (docs/models.md "dtypes").
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict[str, object]:
    """This machine's CPU model, the kernel-choosing flags it has, and the CPUs this process may use."""
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return {"cpu": model, "flags": [f for f in KERNEL_FLAGS if f in flags], "cpus": len(os.sched_getaffinity(0))}


def git_commit() -> str:
    """The checkout's commit (short), `+dirty` when files differ from it; "unknown" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
