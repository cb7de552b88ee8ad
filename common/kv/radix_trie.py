"""The prefix cache's trie of pages and their least-recently-used order (common/kv/prefix_cache.py).

Edges are one page of token ids (a tuple of `page_size` ids); a node holds the page with the KV
of those tokens. A node's **tails** are leaves keyed by fewer than `page_size` tokens: partial
pages continuing it. The trie records nodes only: the allocator's references on their pages, the
sliding partners, the events and the hooks are the cache's.

**Salted trees**: K/V of the same tokens computed another way (longrope's long factors:
common/engine/core.py `Engine.long_rope`) lives in a tree of its own, named by a nonzero `salt`
that the cache's `match`, `insert` and lookups take; a prompt finds only pages of its own salt.
Its blocks are hashed from the salt's root (`block_hashes.salted_root`), and neither reported as
events nor followed by the tier beyond the pool: other nodes and the tier name blocks unsalted
(`TrieNode.is_named`). Eviction and contiguity treat every tree alike.

LRU uses a min-heap of `(last_access, serial, node)` for leaves with lazy invalidation: a
touch pushes a fresh entry and older ones are recognised as stale when popped. Stale entries are
compacted away once they outnumber live nodes, so the heap stays O(cached pages).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from common.kv.block_hashes import ROOT_HASH, chain_hash, salted_root

_HeapEntry = tuple[int, int, "TrieNode"]


class TrieNode:
    __slots__ = ("block_hash", "children", "is_tail", "key", "last_access", "page", "parent", "partial", "removed",
                 "salt", "serial", "tails")

    def __init__(self, key: tuple[int, ...], page: int, parent: TrieNode | None, serial: int,
                 is_tail: bool = False, partial: bool = False, salt: int = 0) -> None:
        self.key = key
        self.salt = salt if parent is None else parent.salt  # the tree's (see "Salted trees")
        # A root's hash is its tree's seed; tails name no block.
        self.block_hash = (salted_root(salt) if parent is None else
                           ROOT_HASH if is_tail else chain_hash(parent.block_hash, key))
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], TrieNode] = {}  # full pages continuing this one
        self.tails: dict[tuple[int, ...], TrieNode] = {}  # partial pages continuing this one
        self.is_tail = is_tail
        self.last_access = 0
        self.serial = serial
        self.removed = False
        self.partial = partial  # some layers' KV is missing (prefix_cache.py, "Partial pages")

    def is_leaf(self) -> bool:
        return not self.children and not self.tails

    def is_named(self) -> bool:
        """Whether other nodes and the tier know this page by its block hash: a full page of
        the unsalted tree."""
        return not self.is_tail and self.salt == 0 and self.parent is not None

    def kids(self) -> Iterator[TrieNode]:
        yield from self.children.values()
        yield from self.tails.values()

    @property
    def parent_hash(self) -> int | None:
        """The block hash of the page this one continues (None: it is a tree's first page)."""
        return None if self.parent.parent is None else self.parent.block_hash


class RadixTrie:
    def __init__(self, page_size: int, takeable: Callable[[TrieNode], bool], window: int | None = None) -> None:
        """`takeable`: whether `lookup` may offer a tail; `window`: a hybrid model's largest
        sliding window, which `lookup` keeps clear of partial pages."""
        self.page_size = page_size
        self.takeable = takeable
        self.window = window
        self._serials = itertools.count()
        self._roots: dict[int, TrieNode] = {}  # by salt
        self._clock = 0
        self._num_nodes = 0
        self._heap: list[_HeapEntry] = []
        self._full: dict[int, TrieNode] = {}  # block hash -> its node, for named pages

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def root(self, salt: int) -> TrieNode:
        """The root of the `salt` tree, made on first use."""
        if salt not in self._roots:
            self._roots[salt] = TrieNode((), -1, None, next(self._serials), salt=salt)
        return self._roots[salt]

    def tops(self) -> Iterator[TrieNode]:
        """The first pages of every tree."""
        for root in self._roots.values():
            yield from root.kids()

    def walk(self, *starts: TrieNode) -> Iterator[TrieNode]:
        """`starts` (every tree's first pages when none) and every node below them, each before
        its kids; iterative, since the trie can be deeper than Python's recursion limit."""
        stack = list(starts or self.tops())
        while stack:
            node = stack.pop()
            stack.extend(node.kids())
            yield node

    def whole_page_of(self, block_hash: int) -> int | None:
        """The page of the named block `block_hash` while recorded whole (None: not so)."""
        node = self._full.get(block_hash)
        return None if node is None or node.partial else node.page

    def page_keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The keys of the full pages `token_ids` fill."""
        ps = self.page_size
        return [tuple(int(t) for t in token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def lookup(self, token_ids: Sequence[int], salt: int) -> tuple[list[TrieNode], TrieNode | None, int]:
        """The longest match of `token_ids` in the `salt` tree that a computation can continue
        from: the path of full pages, then the `takeable` tail matching most of what follows, with
        its matched token count (None, 0: none). With a `window`, every page the window of the
        first computed position reaches is whole (prefix_cache.py, "Partial pages")."""
        path, tail, tail_len = self._match(token_ids, salt)
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

    def _match(self, token_ids: Sequence[int], salt: int) -> tuple[list[TrieNode], TrieNode | None, int]:
        path: list[TrieNode] = []
        node = self._roots.get(salt)
        if node is None:
            return path, None, 0
        for key in self.page_keys(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        start = len(path) * self.page_size
        rest = token_ids[start : start + self.page_size - 1]  # a tail holds fewer than a page
        best, best_len = None, 0
        for tail in node.tails.values():
            n = next((i for i, (x, y) in enumerate(zip(tail.key, rest)) if x != y), min(len(tail.key), len(rest)))
            if n > best_len and self.takeable(tail):
                best, best_len = tail, n
        return path, best, best_len

    def add(self, parent: TrieNode, key: tuple[int, ...], page: int, is_tail: bool = False,
            partial: bool = False) -> TrieNode:
        node = TrieNode(key, page, parent, next(self._serials), is_tail, partial)
        (parent.tails if is_tail else parent.children)[key] = node
        self._num_nodes += 1
        if node.is_named():
            self._full[node.block_hash] = node
        return node

    def detach(self, node: TrieNode) -> None:
        """Forget a leaf."""
        del (node.parent.tails if node.is_tail else node.parent.children)[node.key]
        if node.is_named():
            del self._full[node.block_hash]
        node.removed = True
        self._num_nodes -= 1

    def clear(self) -> list[TrieNode]:
        """Forget every node; returns them, each before its kids."""
        nodes = list(self.walk())
        for node in nodes:
            node.removed = True
        self._roots.clear()
        self._full.clear()
        self._num_nodes = 0
        self._heap.clear()
        return nodes

    def remove_subtrees(self, tops: list[TrieNode], remove: Callable[[TrieNode], None]) -> None:
        """`remove` each node of each of `tops`' subtrees, children before their parents (a top
        in an earlier one's subtree went with it)."""
        for top in tops:
            if not top.removed:
                for node in reversed(list(self.walk(top))):
                    remove(node)
                self._relist_parent(top)

    def touch(self, path: list[TrieNode]) -> None:
        """Mark a root-down path as used now; only its last node can be a leaf."""
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if path[-1].is_leaf():
            self._push(path[-1])

    def _relist_parent(self, node: TrieNode) -> None:
        """`node` went: its parent, when that left it a leaf (and it is not a root), is a
        candidate for LRU eviction."""
        parent = node.parent
        if parent.parent is not None and parent.is_leaf():
            self._push(parent)

    def evict_lru(self, n: int, in_use: Callable[[TrieNode], bool], free: Callable[[TrieNode], None]) -> int:
        """`free` up to `n` leaves, least recently used first, cascading up as parents become
        leaves; leaves `in_use` are skipped (and stay candidates). Returns how many went."""
        freed = 0
        skipped: list[_HeapEntry] = []
        while freed < n and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if self._is_stale(entry):
                continue
            if in_use(node):
                skipped.append(entry)
                continue
            free(node)
            freed += 1
            self._relist_parent(node)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return freed

    def _push(self, node: TrieNode) -> None:
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

