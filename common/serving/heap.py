"""Keep a daemon's freed activation buffers in its heap instead of handing them back to the OS.

A forward allocates and frees megabytes of activations per layer (a 1000-token prompt's MLP
output alone is 6 MB in bf16). glibc serves blocks that large with mmap, or trims them off the
top of the heap when freed, and adapts both thresholds to what the process freed before: a
prefill node's allocation pattern kept them low, so every prefill faulted its buffers in again,
zeroing each page (10,500 minor faults per 1000-token prefill, 2.3x a decode node's), and its
forward ran 7% slower than the same forward in a fresh process. Fixed thresholds above any
activation keep the buffers mapped: the heap holds about one forward's peak, once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top kept before trimming


def keep_freed_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds (False where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("heap", extra={"fields": {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD,
                                       "applied": ok}})
    return ok
