"""Radix prefix cache over KV pages.

A trie whose edges are one page of token ids (a tuple of `page_size` ids) and whose nodes hold
the page with the KV of those tokens. A full page's KV depends only on the tokens up to its end,
so it can be shared read-only by every sequence that starts with those tokens.

A sequence that stops on a partial page leaves that page behind as a **tail**: a leaf hanging off
the node of its last full page, keyed by the fewer than `page_size` tokens it holds. A tail is
never shared. When a new prompt's match runs through the full pages into a tail's leading tokens
and the cache is the tail page's only holder, `match` hands the page itself over: the cache
forgets it, the caller owns it and overwrites the slots past the match (the popped tokens). So a
prompt that extends a finished sequence reuses all of its KV and no page is ever copied. A
partial-page agreement with a page that is shared (a full page, or a tail someone else holds) is
not reused: those tokens are recomputed.

Reference counting: the cache holds one allocator reference on every page it records; `match`
gives the caller one more on each full page it returns, and transfers the cache's own reference
on a tail page it hands over. A page is evictable when the cache is its only holder
(refcount 1) and its node is a leaf (no children, no tails); eviction is least recently used first
and cascades up as parents become leaves. The allocator's refcounts are the only record of who
else holds a page, so in-use leaves are found when eviction reaches them and skipped.

`allocate_contiguous` (what sequences reserve with) lets contiguity choose what to evict: when
the free pages hold no run of the size asked for, it frees the cheapest window of that many
consecutive pages that are free or evictable (the least recently used one, then the one evicting
fewest pages), or failing that the fewest runs of such pages, so the reservation is one or a few
runs of slots instead of the scattered pages LRU order alone would free.

LRU uses a min-heap of `(last_access, serial, node)` for leaves with lazy invalidation: a
touch pushes a fresh entry and older ones are recognised as stale when popped. Stale entries are
compacted away once they outnumber live nodes, so the heap stays O(cached pages).

**Partial pages** (hybrid models, common/engine/attention_window.layer_skips): a page whose KV a
hand-off or migration moved for the full-attention layers only (a sliding layer got its window)
is recorded as partial. With the model's largest sliding `window`, a match ends only where every
page the first computed position's window reaches is whole: a match that would read a partial
page is cut back to the longest that does not (to none at worst). A whole page recorded later for
the same tokens replaces a partial one. A partial tail is not recorded. Where the sliding layers
have a group of their own (common/kv/sliding_pages.py), a page whose sliding K/V went is partial
too; the cache holds the sliding partner of every whole page it records and, when the group runs
short, gives up those of its least recently used pages (`evict_for_sliding`: they turn partial).

A tier beyond the pool (common/engine/kv_offload.py) follows whole full pages through two hooks
that run inside the cache's operation and must not block: `on_cached` is told of every one the
cache starts recording (its block hash, the parent's hash, its tokens), `on_evicted` of every one
eviction is about to free (the same, and its page, still holding the KV). `page_of(block_hash)`
finds such a page while the cache holds it.

With a `KvEventLog`, every full page the cache starts or stops recording is reported by its
chained block hash (common/kv/block_hashes.py), one published change per operation, so other
nodes can tell which prompts this cache would serve. Tails are not reported: they are never shared.

**Salted trees**: K/V of the same tokens computed another way (longrope's long factors:
common/engine/core.py `Engine.long_rope`) lives in a tree of its own, named by a nonzero `salt`
that `match`, `insert` and the lookups take; a prompt finds only pages of its own salt. Its
blocks are hashed from the salt's root (`block_hashes.salted_root`), and neither reported as
events nor followed by the tier beyond the pool: other nodes and the tier name blocks unsalted.
Eviction and contiguity treat every tree alike.

Not thread-safe: one scheduler thread owns the cache and its allocator.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from common.kv.block_hashes import ROOT_HASH, chain_hash, salted_root
from common.kv.events import KvEventLog
from common.kv.page_allocator import OutOfPages, PageAllocator
from common.kv.sliding_pages import SlidingPages

_HeapEntry = tuple[int, int, "_Node"]


class _Node:
    __slots__ = ("key", "page", "parent", "children", "tails", "is_tail", "last_access", "serial", "removed",
                 "block_hash", "partial", "salt")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, serial: int,
                 is_tail: bool = False, partial: bool = False, salt: int = 0) -> None:
        self.key = key
        self.salt = salt if parent is None else parent.salt  # the tree's (see "Salted trees")
        # A root's hash is its tree's seed; tails name no block.
        self.block_hash = (salted_root(salt) if parent is None else
                           ROOT_HASH if is_tail else chain_hash(parent.block_hash, key))
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # full pages continuing this one
        self.tails: dict[tuple[int, ...], _Node] = {}  # partial pages continuing this one
        self.is_tail = is_tail
        self.last_access = 0
        self.serial = serial
        self.removed = False
        self.partial = partial  # some layers' KV is missing (see "Partial pages")

    def is_leaf(self) -> bool:
        return not self.children and not self.tails

    def is_named(self) -> bool:
        """Whether other nodes and the tier know this page by its block hash: a full page of
        the unsalted tree."""
        return not self.is_tail and self.salt == 0 and self.parent is not None

    def kids(self) -> Iterator[_Node]:
        yield from self.children.values()
        yield from self.tails.values()


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, events: KvEventLog | None = None,
                 window: int | None = None, sliding: SlidingPages | None = None) -> None:
        """`window`: a hybrid model's largest sliding window, which partial pages are checked
        against; `sliding`: its sliding group, where the cache holds the partner of every whole
        page it records ("Partial pages")."""
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.allocator = allocator
        self.events = events
        self.page_size = page_size
        self.window = window
        self.sliding = sliding
        self._serials = itertools.count()
        self._roots: dict[int, _Node] = {}  # by salt, made on first insert
        self._clock = 0
        self._num_nodes = 0
        self._heap: list[_HeapEntry] = []
        self.on_cached: Callable[[int, int | None, tuple[int, ...]], None] | None = None
        self.on_evicted: Callable[[int, int | None, tuple[int, ...], int], None] | None = None
        self._full: dict[int, _Node] = {}  # block hash -> its node, for full pages

    @property
    def num_cached_pages(self) -> int:
        return self._num_nodes

    def match(self, token_ids: Sequence[int], salt: int = 0) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids`: `(pages, matched_token_count)`.

        The caller owns one reference on each returned page and must decref it when done. When
        the match ends inside a handed-over tail page (the last returned page), that page is the
        caller's alone and `matched_token_count` is not a multiple of the page size. The whole of
        `token_ids` may match: pass only what may be reused (e.g. `prompt[:-1]`).
        """
        path, tail, tail_len = self._usable(*self._lookup(token_ids, salt))
        pages = [n.page for n in path]
        self.allocator.incref(pages)
        if tail is not None:
            self._detach(tail)  # the cache's reference on the page becomes the caller's
            pages.append(tail.page)
        self._touch(path)
        return pages, len(path) * self.page_size + tail_len

    def matched_length(self, token_ids: Sequence[int], salt: int = 0) -> int:
        """How many tokens `match` would reuse now, without taking or touching anything."""
        path, _, tail_len = self._usable(*self._lookup(token_ids, salt))
        return len(path) * self.page_size + tail_len

    def partial_before(self, token_ids: Sequence[int], salt: int = 0) -> int:
        """The end of the last partial page among those `match(token_ids)` returns (0: none):
        positions before it may lack some layers' KV."""
        path, tail, _ = self._usable(*self._lookup(token_ids, salt))
        nodes = path + ([tail] if tail is not None else [])
        return max((i + 1 for i, n in enumerate(nodes) if n.partial), default=0) * self.page_size

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], partial_before: int = 0, salt: int = 0) -> None:
        """Record a sequence's computed KV: `token_ids[:k*page_size]` -> `pages[:k]` as full
        pages, and a trailing partial page as a tail of the last full page's node. Pages holding a
        position before `partial_before` are partial (some layers' KV is missing).

        Where a node already exists (the same tokens were computed twice), the cached page is kept
        and the caller's duplicate is not referenced, unless the cached one is partial and the
        caller's is whole; so is a cached tail that starts with all of the new tail's tokens.
        Cached tails the new tail extends are dropped (it holds their KV).
        """
        keys = self._page_keys(token_ids)
        tail_tokens = tuple(int(t) for t in token_ids[len(keys) * self.page_size :])
        needed = len(keys) + bool(tail_tokens)
        if len(pages) < needed:
            raise ValueError(f"{len(token_ids)} tokens fill {needed} pages but only {len(pages)} pages given")
        path: list[_Node] = []
        node = self._root(salt)
        for i, (key, page) in enumerate(zip(keys, pages)):
            partial = i * self.page_size < partial_before
            child = node.children.get(key)
            if child is None:
                # A tail on this very page was recorded while its sequence still filled it.
                self._drop_tails(node, lambda t: t.page == page)
                child = self._add(node, key, page, partial=partial)
            elif child.partial and not partial:  # the whole page replaces the partial one
                self.allocator.incref([page])
                self._hold_partner(page)
                self.allocator.decref([child.page])
                child.page, child.partial = page, False
                self._report_cached(child)
            path.append(child)
            node = child
        if tail_tokens and len(keys) * self.page_size >= partial_before:
            tail = next((t for t in node.tails.values() if t.key[: len(tail_tokens)] == tail_tokens), None)
            if tail is None:
                self._drop_tails(node, lambda t: tail_tokens[: len(t.key)] == t.key)
                tail = self._add(node, tail_tokens, pages[len(keys)], is_tail=True)
            path.append(tail)
        self._touch(path)
        self._publish()

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
            self._evict_leaf(node)
            freed += 1
            parent = node.parent
            if parent.parent is not None and parent.is_leaf():
                self._push(parent)
        for entry in in_use:
            heapq.heappush(self._heap, entry)
        self._publish()
        return freed

    def evictable_pages(self) -> int:
        """How many pages `evict` could free now: nodes whose whole subtree is held only by the
        cache. O(cached pages), since other holders' refcounts change without telling the cache."""
        return len(self._evictable_nodes())

    def pages_held_only_here(self) -> int:
        """Cached pages no request holds (what a request would find free, as vLLM counts its free
        blocks); O(cached pages)."""
        stack, count = list(self._tops()), 0
        while stack:
            node = stack.pop()
            stack.extend(node.kids())
            count += self.allocator.refcount(node.page) == 1
        return count

    def _evictable_nodes(self) -> dict[int, tuple[_Node, int]]:
        """By page: the nodes whose whole subtree is held only by the cache, each with the
        latest access in its subtree (what evicting it costs)."""
        evictable: dict[int, tuple[_Node, int]] = {}
        decided: dict[int, int | None] = {}  # by serial: subtree's latest access, None if not evictable
        # Iterative post-order: the trie can be deeper than Python's recursion limit.
        stack: list[tuple[_Node, bool]] = [(c, False) for c in self._tops()]
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

    def clear(self) -> None:
        """Drop every cache reference (pages still held by sequences stay allocated)."""
        stack = list(self._tops())
        while stack:
            node = stack.pop()
            stack.extend(node.kids())
            node.removed = True
            self._report_removed(node)
            self._drop_partner(node)
            self.allocator.decref([node.page])
        self._roots.clear()
        self._full.clear()
        self._num_nodes = 0
        self._heap.clear()
        self._publish()

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Allocate `n` pages (continuing page `after`'s run where free: see
        `PageAllocator.allocate`), evicting LRU cache pages first if the free list is short.

        Raises `OutOfPages` (with `free` counting evictable pages too) without evicting anything
        when even evicting every evictable page would not be enough.
        """
        short = n - self.allocator.num_free
        if short > 0:
            evictable = self.evictable_pages()
            if evictable < short:
                raise OutOfPages(n, self.allocator.num_free + evictable)
            self.evict(short)
        return self.allocator.allocate(n, after)

    def allocate_contiguous(self, n: int, after: int | None = None) -> list[int]:
        """`allocate`, except that when no run of `n` free pages exists, the cached pages in the
        cheapest window of `n` consecutive free-or-evictable pages are evicted (with whatever
        hangs below them: it cannot be matched without them), so the pages come as one run; with
        no such window, those in the fewest runs of free-or-evictable pages that hold `n`."""
        if n > 1 and self.allocator.largest_free_run() < n:
            evictable = self._evictable_nodes()
            for start, length in _spans_to_free(self.allocator, evictable, n):
                for page in range(start, start + length):
                    if page in evictable and not evictable[page][0].removed:
                        self._remove_subtree(evictable[page][0])
            self._publish()
        return self.allocate(n, after)

    def _remove_subtree(self, top: _Node) -> None:
        """Evict a node and everything below it (all held only by the cache)."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.kids())
        for node in reversed(order):  # children before their parents
            self._evict_leaf(node)
        parent = top.parent
        if parent.parent is not None and parent.is_leaf():
            self._push(parent)

    def _root(self, salt: int) -> _Node:
        """The root of the `salt` tree, made on first use."""
        if salt not in self._roots:
            self._roots[salt] = _Node((), -1, None, next(self._serials), salt=salt)
        return self._roots[salt]

    def _tops(self) -> Iterator[_Node]:
        """The first pages of every tree."""
        for root in self._roots.values():
            yield from root.kids()

    def _lookup(self, token_ids: Sequence[int], salt: int) -> tuple[list[_Node], _Node | None, int]:
        """The matching path of full pages in the `salt` tree, then the tail (with its matched
        token count) that `match` would hand over: the one matching most of what follows, among
        those only the cache holds."""
        path: list[_Node] = []
        node = self._roots.get(salt)
        if node is None:
            return path, None, 0
        for key in self._page_keys(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        start = len(path) * self.page_size
        rest = token_ids[start : start + self.page_size - 1]  # a tail holds fewer than a page
        best, best_len = None, 0
        for tail in node.tails.values():
            n = _common_prefix_length(tail.key, rest)
            if n > best_len and self.allocator.refcount(tail.page) == 1:
                best, best_len = tail, n
        return path, best, best_len

    def _usable(self, path: list[_Node], tail: _Node | None,
                tail_len: int) -> tuple[list[_Node], _Node | None, int]:
        """The longest part of a lookup that a computation can continue from: every page the
        window of its first computed position reaches is whole ("Partial pages")."""
        if self.window is None:
            return path, tail, tail_len
        ps, nodes = self.page_size, path + ([tail] if tail is not None else [])
        ends = [len(path) * ps + tail_len] + [k * ps for k in range(len(path), 0, -1)]
        for end in ends:
            first, last = max(0, end - self.window + 1) // ps, (end - 1) // ps
            if not any(n.partial for n in nodes[first : last + 1]):
                keep = -(-end // ps)
                return (path[:keep], tail, tail_len) if end == ends[0] else (path[:keep], None, 0)
        return [], None, 0

    def _page_keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [
            tuple(int(t) for t in token_ids[i : i + ps])
            for i in range(0, len(token_ids) - ps + 1, ps)
        ]

    def _add(self, parent: _Node, key: tuple[int, ...], page: int, is_tail: bool = False,
             partial: bool = False) -> _Node:
        self.allocator.incref([page])
        if not partial:
            self._hold_partner(page)
        node = _Node(key, page, parent, next(self._serials), is_tail, partial)
        (parent.tails if is_tail else parent.children)[key] = node
        self._num_nodes += 1
        if node.is_named():
            self._full[node.block_hash] = node
            if self.events is not None:
                self.events.stored(node.block_hash, self._parent_hash(node), key)
            if not partial:
                self._report_cached(node)
        return node

    def _report_cached(self, node: _Node) -> None:
        if self.on_cached is not None and node.is_named():
            self.on_cached(node.block_hash, self._parent_hash(node), node.key)

    def _evict_leaf(self, node: _Node) -> None:
        if self.on_evicted is not None and node.is_named() and not node.partial:
            self.on_evicted(node.block_hash, self._parent_hash(node), node.key, node.page)
        self._remove_leaf(node)

    @staticmethod
    def _parent_hash(node: _Node) -> int | None:
        return None if node.parent.parent is None else node.parent.block_hash

    def page_of(self, block_hash: int) -> int | None:
        """The page holding the whole full block `block_hash`, while the cache records it."""
        node = self._full.get(block_hash)
        return None if node is None or node.partial else node.page

    def _drop_tails(self, node: _Node, which: Callable[[_Node], bool]) -> None:
        for tail in [t for t in node.tails.values() if which(t)]:
            self._remove_leaf(tail)

    def _touch(self, path: list[_Node]) -> None:
        """Mark a root-down path as used now; only its last node can be a leaf."""
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if path[-1].is_leaf():
            self._push(path[-1])

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, node.serial, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _is_stale(self, entry: _HeapEntry) -> bool:
        last_access, _, node = entry
        return node.removed or not node.is_leaf() or node.last_access != last_access

    def _compact_heap(self) -> None:
        live = {id(e[2]): e for e in self._heap if not self._is_stale(e)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def _detach(self, node: _Node) -> None:
        """Forget a leaf without dropping the cache's reference on its page."""
        del (node.parent.tails if node.is_tail else node.parent.children)[node.key]
        if node.is_named():
            del self._full[node.block_hash]
        node.removed = True
        self._num_nodes -= 1
        self._report_removed(node)

    def _report_removed(self, node: _Node) -> None:
        if self.events is not None and node.is_named():
            self.events.removed(node.block_hash)

    def _publish(self) -> None:
        if self.events is not None:
            self.events.publish()

    def _remove_leaf(self, node: _Node) -> None:
        self._detach(node)
        self._drop_partner(node)
        self.allocator.decref([node.page])

    def _hold_partner(self, page: int) -> None:
        """A whole page's sliding K/V stays while the cache records it (the recorder holds it)."""
        if self.sliding is not None:
            self.sliding.hold([page], make=False)

    def _drop_partner(self, node: _Node) -> None:
        if self.sliding is not None and not node.partial:
            self.sliding.drop([node.page])

    def evict_for_sliding(self, n: int) -> None:
        """Free up to `n` sliding pages: the sliding K/V of whole pages that only the cache keeps,
        least recently used first, goes; a full page stays, partial (it still serves a match
        whose window does not reach it), a tail goes with it (a partial tail is not recorded)."""
        stack, whole = list(self._tops()), []
        while stack:
            node = stack.pop()
            stack.extend(node.kids())
            if not node.partial and self.sliding.holders(node.page) == 1 and (
                    not node.is_tail or self.allocator.refcount(node.page) == 1):
                whole.append(node)
        for node in sorted(whole, key=lambda node: node.last_access)[:n]:
            if node.is_tail:
                self._remove_leaf(node)
            else:
                self._drop_partner(node)
                node.partial = True
        self._publish()


def _spans_to_free(allocator: PageAllocator, evictable: dict[int, tuple[_Node, int]], n: int) -> list[tuple[int, int]]:
    """(first page, length) spans of free or evictable pages, `n` pages in all, as few as there
    can be: the window whose most recently used evictable page is the least recent (then the one
    evicting fewest pages) when one span can hold `n`; else the longest runs, the last one best
    fit. Empty when the free and evictable pages together are fewer than `n`."""
    num_pages = allocator.num_pages
    cost = np.full(num_pages, np.inf)  # in use: never
    for start, length in allocator.free_extents():
        cost[start : start + length] = -1.0  # free: nothing lost
    evicted = np.zeros(num_pages + 1, dtype=np.int64)
    for page, (_, last_access) in evictable.items():
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
