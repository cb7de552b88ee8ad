"""Reference-counted allocator of fixed-size KV pages that keeps reservations contiguous.

Free pages are kept as *extents* (maximal runs of consecutive free page ids), coalesced as pages
are freed. A request for `n` pages gets the fewest runs the free pages allow: the smallest extent
holding all `n` (best fit, so large extents survive for large requests), or, when none does, the
largest extents first and a best fit for the remainder. A transfer then moves each layer's K|V
as a few large ranges instead of one range per page (`kv_append_metadata` compresses).

`allocate(n, after=p)` first continues page `p`'s run when page `p + 1` starts a free extent, so
a sequence that grows (a reservation after a matched prefix, decode appends) stays one run.

Among extents of the best-fitting length the one freed longest ago is used first. Reuse order
is not what protects a page from a late one-sided writer: those pages stay allocated under a
write fence (common/transports/fences.py) until the writer is provably done.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterable


class OutOfPages(Exception):
    """The pool has fewer free pages than the caller asked for."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV pages but only {free} are free")
        self.requested = requested
        self.free = free


class PageAllocator:
    """Hands out page ids in `[0, num_pages)`; a page returns to the free extents when its
    reference count drops to zero, and then `on_free(pages)` runs with the pages freed (the engine
    wakes admission)."""

    def __init__(self, num_pages: int, on_free: Callable[[list[int]], None] = lambda pages: None) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._on_free = on_free
        self._refcount = [0] * num_pages
        self._num_free = 0
        self._length_at: dict[int, int] = {}  # first page of a free extent -> its length
        self._start_of: dict[int, int] = {}  # last page of a free extent -> its first page
        self._by_length: dict[int, OrderedDict[int, None]] = {}  # length -> first pages, oldest first
        self._lengths: list[int] = []  # the keys of _by_length, sorted
        self._add_extent(0, num_pages)

    @property
    def num_free(self) -> int:
        return self._num_free

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def largest_free_run(self) -> int:
        """Length of the longest run of consecutive free pages."""
        return self._lengths[-1] if self._lengths else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """The free pages as (first page, length) runs, in page order."""
        return sorted(self._length_at.items())

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` free pages (reference count 1 each), all or nothing, in as few runs of
        consecutive ids as the free pages allow; with `after`, continuing that page's run first
        when the page after it is free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > self._num_free:
            raise OutOfPages(n, self._num_free)
        pages: list[int] = []
        if n and after is not None and after + 1 in self._length_at:
            pages += self._take(after + 1, n)
        while len(pages) < n:
            need = n - len(pages)
            i = bisect.bisect_left(self._lengths, need)
            length = self._lengths[i] if i < len(self._lengths) else self._lengths[-1]
            pages += self._take(next(iter(self._by_length[length])), need)
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
                self._free_page(p)
                freed.append(p)
        if freed:
            self._on_free(freed)
        return freed

    def _free_page(self, page: int) -> None:
        """Return one page, merging it with the free extents on either side."""
        start, end = page, page + 1
        if page - 1 in self._start_of:
            start = self._start_of[page - 1]
            self._remove_extent(start)
        if end in self._length_at:
            end += self._remove_extent(end)
        self._add_extent(start, end - start)

    def _take(self, start: int, n: int) -> list[int]:
        """Up to `n` pages from the front of the free extent at `start`; the rest stays free."""
        length = self._remove_extent(start)
        taken = min(n, length)
        if taken < length:
            self._add_extent(start + taken, length - taken)
        return list(range(start, start + taken))

    def _add_extent(self, start: int, length: int) -> None:
        self._length_at[start] = length
        self._start_of[start + length - 1] = start
        bucket = self._by_length.get(length)
        if bucket is None:
            bucket = self._by_length[length] = OrderedDict()
            bisect.insort(self._lengths, length)
        bucket[start] = None
        self._num_free += length

    def _remove_extent(self, start: int) -> int:
        length = self._length_at.pop(start)
        del self._start_of[start + length - 1]
        bucket = self._by_length[length]
        del bucket[start]
        if not bucket:
            del self._by_length[length]
            self._lengths.pop(bisect.bisect_left(self._lengths, length))
        self._num_free -= length
        return length
