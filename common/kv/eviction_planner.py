"""Which cached pages to evict so that a reservation's pages come as one run, or as few as can be
(`PrefixCache.allocate_contiguous`).

When the free pages hold no run of the size asked for, contiguity chooses what to evict: the
cheapest window of that many consecutive pages that are free or evictable (the least recently
used one, then the one evicting fewest pages), or failing that the fewest runs of such pages, so
the reservation is one or a few runs of slots instead of the scattered pages LRU order alone
would free. A page is evictable when the cache is the only holder of it and of every page below
its node (evicting it takes those too: they cannot be matched without it).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from common.kv.page_allocator import PageAllocator
from common.kv.radix_trie import TrieNode


class EvictionPlanner:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def evictable(self, tops: Iterable[TrieNode]) -> dict[int, tuple[TrieNode, int]]:
        """By page: the nodes under `tops` whose whole subtree is held only by the cache, each
        with the latest access in its subtree (what evicting it costs). O(cached pages), since
        other holders' refcounts change without telling the cache."""
        evictable: dict[int, tuple[TrieNode, int]] = {}
        decided: dict[int, int | None] = {}  # by serial: subtree's latest access, None if not evictable
        # Iterative post-order: the trie can be deeper than Python's recursion limit.
        stack: list[tuple[TrieNode, bool]] = [(c, False) for c in tops]
        while stack:
            node, kids_done = stack.pop()
            if not kids_done:
                stack.append((node, True))
                stack.extend((c, False) for c in node.kids())
                continue
            kids = [decided.pop(c.serial) for c in node.kids()]
            ok = None not in kids and self.allocator.refcount(node.page) == 1
            decided[node.serial] = max([node.last_access, *kids]) if ok else None
            if ok:
                evictable[node.page] = (node, decided[node.serial])
        return evictable

    def to_evict_for_run(self, tops: Iterable[TrieNode], n: int) -> list[TrieNode]:
        """The evictable nodes on the pages `spans_to_free` picks for `n` pages, in page order:
        evicting each with its subtree (skipping those an earlier one took) frees those pages."""
        evictable = self.evictable(tops)
        spans = spans_to_free(self.allocator, {page: cost for page, (_, cost) in evictable.items()}, n)
        return [evictable[page][0] for start, length in spans for page in range(start, start + length)
                if page in evictable]


def spans_to_free(allocator: PageAllocator, evictable: Mapping[int, int], n: int) -> list[tuple[int, int]]:
    """(first page, length) spans of free or `evictable` pages (each with its eviction cost, a
    latest access), `n` pages in all, as few as there can be: the window whose most recently used
    evictable page is the least recent (then the one evicting fewest pages) when one span can hold
    `n`; else the longest runs, the last one best fit. Empty when the free and evictable pages
    together are fewer than `n`."""
    num_pages = allocator.num_pages
    cost = np.full(num_pages, np.inf)  # in use: never
    for start, length in allocator.free_extents():
        cost[start : start + length] = -1.0  # free: nothing lost
    evicted = np.zeros(num_pages + 1, dtype=np.int64)
    for page, last_access in evictable.items():
        cost[page] = last_access
        evicted[page + 1] = 1
    if n <= num_pages:
        worst = _sliding_max(cost, n)
        if np.isfinite(worst.min()):
            counts = np.cumsum(evicted)
            return [(int(np.lexsort((counts[n:] - counts[:-n], worst))[0]), n)]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.isfinite(cost).astype(np.int8), [0]])))
    runs = sorted(zip((edges[1::2] - edges[::2]).tolist(), edges[::2].tolist()), reverse=True)
    spans, need = [], n
    while need > 0 and runs:
        fit = min((r for r in runs if r[0] >= need), default=None)
        length, start = fit or runs[0]
        spans.append((start, min(length, need)))
        need -= min(length, need)
        runs.remove(fit or runs[0])
    return spans if need == 0 else []


def _sliding_max(values: np.ndarray, n: int) -> np.ndarray:
    """`max(values[i : i + n])` for every window, in O(len * log n) (doubling widths)."""
    width, table = 1, values
    while 2 * width <= n:
        table = np.maximum(table[:-width], table[width:])
        width *= 2
    return np.maximum(table[: len(values) - n + 1], table[n - width : n - width + len(values) - n + 1])
