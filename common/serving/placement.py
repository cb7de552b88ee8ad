"""Where a daemon's threads run: its CPU set (`--cpus`), its torch thread pools, its priority
(`--nice`).

Two daemons on one host that each size their thread pools to every core fight for them: their
OpenMP threads preempt each other mid-layer and every step waits for its slowest thread. The
defaults avoid that without a core split:
- torch's intra-op pool gets one thread per CPU the process may run on (`os.sched_getaffinity`,
  after `--cpus` is applied), not per CPU of the machine; the inter-op pool, which the engine
  does not use, one thread;
- the prefill node runs at a lower priority (`--nice 10` by default), so the kernel scheduler
  gives a decode node on the same cores the CPU whenever its step wants it, and the prefill node
  the time the decode node leaves idle (between steps, while it samples and streams). A decode
  node is never starved by its host's prefill node, and neither sits idle while the other waits.
`--cpus` gives each daemon its own cores instead (docs/bench/README.md compares the two).
"""
from __future__ import annotations

import logging
import os

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


def apply(cpus: tuple[int, ...] | None, threads: int | None, nice: int) -> int:
    """Pin this process to `cpus` (None: keep what it was started with), lower its priority by
    `nice`, and size torch's thread pools; returns the intra-op thread count (`threads`, else
    one per CPU of the process's affinity)."""
    import torch

    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            raise ValueError(f"--cpus {','.join(map(str, cpus))}: {exc.strerror}") from None
    if nice:
        os.nice(nice)
    count = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass
    log.info("placement", extra={"fields": {"cpus": sorted(os.sched_getaffinity(0)), "threads": count,
                                            "nice": os.nice(0)}})
    return count
