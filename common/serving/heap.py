"""Keep a daemon's freed activation buffers in its heap instead of handing them back to the OS.

A forward allocates and frees megabytes of activations per layer (a 1000-token prompt's MLP
output alone is 6 MB in bf16). glibc serves blocks that large with mmap, or trims them off the
top of the heap when freed, and adapts both thresholds to what the process freed before: a
prefill node's allocation pattern kept them low, so every prefill faulted its buffers in again,
zeroing each page, and its forward ran slower than the same forward in a fresh process
(docs/bench/README.md, "Figures behind the code"). Fixed thresholds above any
activation keep the buffers mapped: the heap holds about one forward's peak, once.

Thresholds alone are not enough where a thread other than the main one computes: glibc gives it
an arena of 64 MB heaps, and a forward that outgrows one (a fp32 prefill does) maps a second
heap and unmaps it again when its buffers are freed, once per layer. One arena, the main heap,
which grows without such
a limit, holds them all; the daemons' threads rarely allocate at once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top kept before trimming
ARENA_MAX = 1  # every thread allocates from the main heap, which the trim threshold governs


def keep_freed_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds (False where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = {M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_ARENA_MAX: ARENA_MAX}
    ok = all([bool(mallopt(param, value)) for param, value in settings.items()])
    log.info("heap", extra={"fields": {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD,
                                       "arena_max": ARENA_MAX, "applied": ok}})
    return ok
