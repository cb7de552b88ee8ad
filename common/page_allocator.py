"""Reference-counted allocator of fixed-size KV pages.

Pages are handed out FIFO from the free list: a page that was just freed is the last to be
reused, which keeps a late writer's target pages out of circulation as long as possible.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfPages(Exception):
    """The pool has fewer free pages than the caller asked for."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV pages but only {free} are free")
        self.requested = requested
        self.free = free


class PageAllocator:
    """Hands out page ids in `[0, num_pages)`; a page returns to the free list when its
    reference count drops to zero."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (reference count 1 each), all or nothing."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; return the pages that became free."""
        freed = []
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated (double free)")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed
