"""Write fences: pages a writer may still write stay out of circulation until it is proven done.

A fence is one extra reference on each page of a `WriteWindow`, raised for one writer. What lifts
it depends on what the receiver can prove:

- TCP: the receiver copies every byte itself, so the fence is up only while a connection
  writes, and comes down when that connection ends. Nothing is ever quarantined.
- NIXL: the writer writes one-sided; nothing on the receiving side sees its bytes or can stop a
  posted write. The fence goes up when the writer is admitted and comes down when the writer
  reports it is done (CompleteTransfer, or CompleteTransfer with `abandoned` after making sure
  none of its writes is still in flight) or, without a word from it (killed, cut off), after
  `--quarantine-seconds`, which must exceed the writers' `--transfer-timeout-seconds`, unless
  the KV owner proves sooner that the writer's run is over (`lift_writer_run`: it restarted
  with a new incarnation, or its process is gone from this host).

Meanwhile the pages of a window whose reservation is gone (expired, aborted) stay allocated and
count as quarantined: a late write lands in memory nobody reads.

Every method takes the engine lock itself (the lock that guards the allocator).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.kv.page_allocator import PageAllocator
from common.kv.sliding_pages import SlidingPages

if TYPE_CHECKING:
    from common.transports.connector import WriteWindow


@dataclass(frozen=True, eq=False)
class Fence:
    window: WriteWindow
    deadline: float | None  # time.monotonic() when the quarantine ends; None: the receiver lifts it


class WriteFences:
    def __init__(self, allocator: PageAllocator, lock: threading.RLock, quarantine_seconds: float,
                 sliding: SlidingPages | None = None) -> None:
        """`sliding`: the pool's sliding group, whose partners of a window's `windowed` pages
        are fenced with them (a writer writes the sliding layers' window there)."""
        self._allocator = allocator
        self._sliding = sliding
        self._lock = lock
        self._quarantine_seconds = quarantine_seconds
        self._fences: list[Fence] = []  # oldest first; a window may see several writers

    def raise_fence(self, window: WriteWindow, quarantine: bool) -> Fence:
        """Fence `window`'s pages for one writer. With `quarantine` the fence also falls by
        itself after --quarantine-seconds (for a writer nobody can watch)."""
        deadline = time.monotonic() + self._quarantine_seconds if quarantine else None
        fence = Fence(window, deadline)
        with self._lock:
            self._allocator.incref(window.pages)
            if self._sliding is not None:
                self._sliding.hold(window.windowed, make=False)
            self._fences.append(fence)
        return fence

    def lift(self, fence: Fence) -> None:
        with self._lock:
            self._fences.remove(fence)
            if self._sliding is not None:
                self._sliding.drop(fence.window.windowed)
            self._allocator.decref(fence.window.pages)

    def lift_writer(self, request_id: str, nonce: int) -> bool:
        """Lift the oldest fence of the writer of (request_id, nonce); False if it has none."""
        with self._lock:
            fence = next((f for f in self._fences if (f.window.request_id, f.window.nonce) == (request_id, nonce)),
                         None)
            if fence is not None:
                self.lift(fence)
            return fence is not None

    def lift_writer_run(self, writer: int) -> int:
        """Lift every quarantine fence of the writer run (incarnation) `writer`, proven over;
        how many pages came back into circulation (not counting those still reserved)."""
        with self._lock:
            fences = [f for f in self._fences if writer and f.window.writer == writer and f.deadline is not None]
            free_before = self._allocator.num_free
            for fence in fences:
                self.lift(fence)
            return self._allocator.num_free - free_before

    def quarantined_writers(self) -> set[int]:
        """The writer runs whose fences wait for their quarantine."""
        with self._lock:
            return {f.window.writer for f in self._fences if f.deadline is not None and f.window.writer}

    def expire_due(self, now: float) -> int:
        """Lift the quarantine fences whose writer never reported back in time; how many."""
        with self._lock:
            due = [f for f in self._fences if f.deadline is not None and f.deadline <= now]
            for fence in due:
                self.lift(fence)
            return len(due)

    def quarantined_pages(self) -> int:
        """Pages fenced only for writers whose reservation is gone."""
        with self._lock:
            return len({p for f in self._fences if not f.window.alive() for p in f.window.pages})

    def lift_all(self) -> None:
        with self._lock:
            for fence in list(self._fences):
                self.lift(fence)
