"""Where a daemon's threads run: its CPU set (`--cpus`), its torch thread pools, its priority
(`--nice`).

Two daemons on one host that each size their thread pools to every core fight for them: their
OpenMP threads preempt each other mid-layer and every step waits for its slowest thread. The
defaults avoid that without a core split:
- torch's intra-op pool gets one thread per CPU the process may run on (`os.sched_getaffinity`,
  after `--cpus` is applied), not per CPU of the machine, and no more than whole CPUs of its
  cgroup's quota (`cpu.max`, or cgroup v1's `cpu.cfs_quota_us`): spinning threads beyond the quota
  would spend it at barriers and then wait out the period; the inter-op pool, which the engine
  does not use, one thread. That count is a ceiling: without `--threads`, the engine computes
  with fewer while neighbours hold some of those cores (common/engine/compute_threads.py);
- the prefill node runs at a lower priority (`--nice 10` by default), so the kernel scheduler
  gives a decode node on the same cores the CPU whenever its step wants it, and the prefill node
  the time the decode node leaves idle (between steps, while it samples and streams). A decode
  node is never starved by its host's prefill node, and neither sits idle while the other waits.
`--cpus` gives each daemon its own cores instead (docs/bench/README.md compares the two).

Only the engine's thread computes in parallel. libgomp keeps a pool of worker threads for every
thread that ever ran a parallel region, for as long as that thread lives, and once its pools hold
more threads than the process has CPUs it stops spinning at barriers: every parallel region then
wakes its workers from a futex sleep, which on 2 cores made a colocated node's inter-token latency
half as long again (docs/bench/README.md); on a bigger host each gRPC or transport thread
that gathers KV for a checksum or a send would add a pool of one worker per core. So:
- a daemon builds its node (weights converted and packed, KV pool filled: parallel work) in a
  thread that has exited when the build returns, taking its pool with it (`in_passing_thread`);
- the engine loop's thread fixes its own thread count first thing (torch, and each kernel
  library, reads the count once per thread: common/engine/loop.py, cpu/intra_op_threads.cpp),
  then `serialize_other_threads` gives every other thread one: their torch work (checksums,
  transport gathers) runs on the calling thread alone.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


def parse_cpus(text: str) -> tuple[int, ...]:
    """CPU numbers from a list such as `0`, `0,2` or `0-3,6` (as taskset -c takes them)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"--cpus must be a list like 0 or 0-3,6, got {text!r}") from None
    return tuple(sorted(cpus))


def cgroup_memberships(membership: Path = Path("/proc/self/cgroup")) -> list[tuple[str, str]]:
    """(controllers, path) of each hierarchy this process is in; controllers "" is cgroup v2."""
    return [tuple(line.split(":", 2)[1:]) for line in membership.read_text().splitlines()]


def quota_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"),
               membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs this process's cgroups allow it per period (the tightest quota of its cgroup and
    every parent, v2 `cpu.max` or v1 `cpu.cfs_quota_us`), or None where no quota is set."""
    quotas = []
    for controllers, path in cgroup_memberships(membership):
        if controllers == "":  # cgroup v2
            base, files = cgroup_root, ("cpu.max",)
        elif "cpu" in controllers.split(","):  # cgroup v1, where the cpu controller is mounted
            base = next((cgroup_root / name for name in (controllers, "cpu", "cpu,cpuacct")
                         if (cgroup_root / name).is_dir()), None)
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if base is None:
                continue
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            quotas.append(_quota_in(directory, files))
            if directory == base:
                break
            directory = directory.parent
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _quota_in(directory: Path, files: tuple[str, ...]) -> float | None:
    """CPUs per period that one cgroup directory allows, None where it sets no quota."""
    try:
        values = " ".join((directory / name).read_text() for name in files).split()
        quota, period = values[0], values[1]
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, IndexError, ValueError):
        return None


def thread_ceiling() -> int:
    """One thread per CPU of this process's affinity, and at most the whole CPUs of its quota."""
    count = len(os.sched_getaffinity(0))
    quota = quota_cpus()
    return count if quota is None else max(1, min(count, int(quota)))


def apply(cpus: tuple[int, ...] | None, threads: int | None, nice: int) -> int:
    """Pin this process to `cpus` (None: keep what it was started with), lower its priority by
    `nice`, and size torch's thread pools; returns the intra-op thread count (`threads`, else
    `thread_ceiling()`)."""
    import torch

    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            raise ValueError(f"--cpus {','.join(map(str, cpus))}: {exc.strerror}") from None
    if nice:
        os.nice(nice)
    count = threads or thread_ceiling()
    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass
    log.info("placement", extra={"fields": {"cpus": sorted(os.sched_getaffinity(0)), "threads": count,
                                            "adaptive": threads is None, "cpu_quota": quota_cpus(),
                                            "nice": os.nice(0)}})
    return count


def in_passing_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` run in a thread of its own that has ended when this returns (see the module
    docstring: the OpenMP pool its parallel work created ends with it); its exception is raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="build") as pool:
        return pool.submit(fn, *args).result()


def serialize_other_threads() -> None:
    """From now on a thread that first runs torch work gets one intra-op thread; threads that
    already fixed their count (the engine loop's) keep it. Call once the node is built."""
    import torch

    torch.set_num_threads(1)
