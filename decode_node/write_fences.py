"""Write fences: pages a one-sided writer may still touch stay out of circulation.

With NIXL the prefill node writes straight into this node's memory. Nothing here sees those
bytes, and nothing can stop a write that is already posted, so a transfer that outlives its
reservation (slow prefill, short lease, an Abort) would land in pages already handed to the
next request. BeginTransfer, the writer's check before its first byte, therefore pins the
reservation's pages with one extra reference each. The pin is dropped when

- the writer reports it is done: CompleteTransfer, or CompleteTransfer with `abandoned` when
  it gave up after making sure none of its writes is still in flight; or
- the writer vanished without a word (killed, cut off): after `--quarantine-seconds`, which must
  exceed the prefill nodes' `--transfer-timeout-seconds`, the longest a writer keeps writing.

Meanwhile an expired or aborted reservation's pages stay allocated, counted as quarantined:
a late write lands in memory nobody reads. The TCP transport needs no fence: the receiver
itself copies the bytes and pins the pages for as long as the writer's connection lasts.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.kv.page_allocator import PageAllocator


@dataclass(frozen=True)
class _Fence:
    request_id: str
    nonce: int
    pages: tuple[int, ...]
    deadline: float  # time.monotonic()


class WriteFences:
    """Every method must be called with `engine.lock` held."""

    def __init__(self, allocator: PageAllocator, quarantine_seconds: float) -> None:
        self._allocator = allocator
        self._quarantine_seconds = quarantine_seconds
        self._fences: list[_Fence] = []  # oldest first; a reservation may see several writers

    def pin(self, request_id: str, nonce: int, pages: list[int]) -> None:
        """A writer may write `pages` from now on."""
        self._allocator.incref(pages)
        self._fences.append(_Fence(request_id, nonce, tuple(pages), time.monotonic() + self._quarantine_seconds))

    def unpin(self, request_id: str, nonce: int) -> bool:
        """One writer of (request_id, nonce) finished; False if none was fenced."""
        for fence in self._fences:
            if (fence.request_id, fence.nonce) == (request_id, nonce):
                self._drop(fence)
                return True
        return False

    def expire_due(self, now: float) -> int:
        """Drop fences whose writer never reported back in time; how many were dropped."""
        due = [f for f in self._fences if f.deadline <= now]
        for fence in due:
            self._drop(fence)
        return len(due)

    def quarantined_pages(self, is_live: Callable[[str, int], bool]) -> int:
        """Pages pinned only for writers whose reservation is gone (`is_live(request_id, nonce)`
        says whether it still exists)."""
        return len({p for f in self._fences if not is_live(f.request_id, f.nonce) for p in f.pages})

    def release_all(self) -> None:
        for fence in list(self._fences):
            self._drop(fence)

    def _drop(self, fence: _Fence) -> None:
        self._fences.remove(fence)
        self._allocator.decref(fence.pages)
