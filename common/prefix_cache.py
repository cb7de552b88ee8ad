"""Radix prefix cache over KV pages.

A trie whose edges are one page of token ids (a tuple of `page_size` ids) and whose nodes hold
the page with the KV of those tokens. Matching is **page-granular**: only whole pages are shared,
so a prompt that agrees with a cached one for 1.5 pages reuses one page and recomputes the rest.
A full page's KV depends only on the tokens up to its end, so it can be shared read-only; sharing
a partial page would need copy-on-write, since each sharer appends different tokens into it.

Reference counting: the cache holds one allocator reference on every page it records; `match`
gives the caller one more on each page it returns. A page is evictable when the cache is its
only holder (refcount 1) and its node is a leaf; eviction is least recently used first and
cascades up as parents become leaves. The allocator's refcounts are the only record of who else
holds a page, so in-use leaves are found when eviction reaches them and skipped.

LRU uses a min-heap of `(last_access, serial, node)` for leaves with lazy invalidation: a
touch pushes a fresh entry and older ones are recognised as stale when popped. Stale entries are
compacted away once they outnumber live nodes, so the heap stays O(cached pages).

Not thread-safe: one scheduler thread owns the cache and its allocator.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from common.page_allocator import OutOfPages, PageAllocator

_HeapEntry = tuple[int, int, "_Node"]


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_access", "serial", "removed")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, serial: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0
        self.serial = serial
        self.removed = False


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.allocator = allocator
        self.page_size = page_size
        self._serials = itertools.count()
        self._root = _Node((), -1, None, next(self._serials))
        self._clock = 0
        self._num_nodes = 0
        self._heap: list[_HeapEntry] = []

    @property
    def num_cached_pages(self) -> int:
        return self._num_nodes

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` in whole pages: `(pages, matched_token_count)`.

        The caller owns one reference on each returned page and must decref it when done. The
        whole of `token_ids` may match: pass only what may be reused (e.g. `prompt[:-1]`).
        """
        path: list[_Node] = []
        node = self._root
        for key in self._page_keys(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        pages = [n.page for n in path]
        self.allocator.incref(pages)
        self._touch(path)
        return pages, len(pages) * self.page_size

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Record the full pages of a sequence: `token_ids[:k*page_size]` -> `pages[:k]`.

        A trailing partial page is ignored. Where a node already exists (the same tokens were
        computed twice), the cached page is kept and the caller's duplicate is not referenced.
        """
        keys = self._page_keys(token_ids)
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full pages of tokens but only {len(pages)} pages given")
        path: list[_Node] = []
        node = self._root
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                self.allocator.incref([page])
                child = _Node(key, page, node, next(self._serials))
                node.children[key] = child
                self._num_nodes += 1
            path.append(child)
            node = child
        self._touch(path)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` cached pages that nobody else references, LRU first.

        Returns how many pages were freed. Leaves still referenced by a sequence are skipped.
        """
        freed = 0
        in_use: list[_HeapEntry] = []
        while freed < num_pages and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if self._is_stale(entry):
                continue
            if self.allocator.refcount(node.page) > 1:
                in_use.append(entry)
                continue
            self._remove_leaf(node)
            freed += 1
            parent = node.parent
            if parent is not self._root and not parent.children:
                self._push(parent)
        for entry in in_use:
            heapq.heappush(self._heap, entry)
        return freed

    def evictable_pages(self) -> int:
        """How many pages `evict` could free now: nodes whose whole subtree is held only by the
        cache. O(cached pages), since other holders' refcounts change without telling the cache."""
        count = 0
        evictable: dict[int, bool] = {}  # by serial, for nodes whose children are all decided
        # Iterative post-order: the trie can be deeper than Python's recursion limit.
        stack: list[tuple[_Node, bool]] = [(c, False) for c in self._root.children.values()]
        while stack:
            node, children_done = stack.pop()
            if not children_done:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children.values())
                continue
            children_ok = [evictable.pop(c.serial) for c in node.children.values()]
            ok = all(children_ok) and self.allocator.refcount(node.page) == 1
            evictable[node.serial] = ok
            count += ok
        return count

    def clear(self) -> None:
        """Drop every cache reference (pages still held by sequences stay allocated)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.removed = True
            self.allocator.decref([node.page])
        self._root.children.clear()
        self._num_nodes = 0
        self._heap.clear()

    def allocate(self, n: int) -> list[int]:
        """Allocate `n` pages, evicting LRU cache pages first if the free list is short.

        Raises `OutOfPages` (with `free` counting evictable pages too) without evicting anything
        when even evicting every evictable page would not be enough.
        """
        short = n - self.allocator.num_free
        if short > 0:
            evictable = self.evictable_pages()
            if evictable < short:
                raise OutOfPages(n, self.allocator.num_free + evictable)
            self.evict(short)
        return self.allocator.allocate(n)

    def _page_keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [
            tuple(int(t) for t in token_ids[i : i + ps])
            for i in range(0, len(token_ids) - ps + 1, ps)
        ]

    def _touch(self, path: list[_Node]) -> None:
        """Mark a root-down path as used now; only its last node can be a leaf."""
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if not path[-1].children:
            self._push(path[-1])

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, node.serial, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _is_stale(self, entry: _HeapEntry) -> bool:
        last_access, _, node = entry
        return node.removed or bool(node.children) or node.last_access != last_access

    def _compact_heap(self) -> None:
        live = {id(e[2]): e for e in self._heap if not self._is_stale(e)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def _remove_leaf(self, node: _Node) -> None:
        del node.parent.children[node.key]
        node.removed = True
        self._num_nodes -= 1
        self.allocator.decref([node.page])
