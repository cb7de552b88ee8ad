"""Radix prefix cache over KV pages: `PrefixCache`, over a trie of pages with its LRU order
(radix_trie.py), a planner of what to evict for a run of pages (eviction_planner.py) and the
sliding partners it holds for a hybrid model (sliding_partners.py).

A full page's KV depends only on the tokens up to its end, so every sequence that starts with
those tokens can share it read-only. A sequence that stops on a partial page leaves it behind as
a **tail**, never shared: when a new prompt's match runs through the full pages into a tail's
leading tokens and the cache is the tail page's only holder, `match` hands the page itself over
(the cache forgets it, the caller overwrites the slots past the match), so a prompt that extends
a finished sequence reuses all of its KV and no page is ever copied. A partial-page agreement
with a page that is shared (a full page, or a tail someone else holds) is recomputed.

Reference counting: the cache holds one allocator reference on every page it records; `match`
gives the caller one more on each full page it returns, and transfers the cache's own reference
on a tail page it hands over. A page is evictable when the cache is its only holder
(refcount 1) and its node is a leaf (no children, no tails); eviction is least recently used
first and cascades up as parents become leaves. The allocator's refcounts are the only record of
who else holds a page, so eviction skips the in-use leaves it reaches.

**Partial pages** (hybrid models, common/engine/attention_window.layer_skips): a page whose KV a
hand-off or migration moved for the full-attention layers only (a sliding layer got its window)
is recorded as partial. With the model's largest sliding `window`, a match ends only where every
page the first computed position's window reaches is whole: a match that would read a partial
page is cut back to the longest that does not (to none at worst). A whole page recorded later for
the same tokens replaces a partial one. A partial tail is not recorded. Where the sliding layers
have a group of their own, a page whose sliding K/V went is partial too (sliding_partners.py).

A tier beyond the pool (common/engine/kv_offload.py) follows whole full pages through two hooks
that run inside the cache's operation and must not block: `on_cached` is told of every one the
cache starts recording (its block hash, the parent's hash, its tokens), `on_evicted` of every one
eviction is about to free (the same, and its page, still holding the KV). `page_of(block_hash)`
finds such a page while the cache holds it. With a `KvEventLog`, every full page the cache starts
or stops recording is reported by its chained block hash (common/kv/block_hashes.py), one
published change per operation, so other nodes can tell which prompts this cache would serve;
not tails (never shared), nor a salted tree's pages (radix_trie.py, "Salted trees": the `salt`).

**Locking**: not thread-safe. Every call holds the engine's lock (`Engine.lock`, reentrant; it
guards the allocator and the sliding group too), whichever thread makes it: the engine calls the
cache from its `locked` methods (the scheduler's step included); the gRPC threads (decode_node/
prefix_fetch.py, admission.py), the disk tier (common/engine/kv_offload.py) and the metrics take
it themselves. Given that `lock`, the methods that change the cache check the caller holds it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from common.kv.events import KvEventLog
from common.kv.eviction_planner import EvictionPlanner
from common.kv.page_allocator import OutOfPages, PageAllocator
from common.kv.radix_trie import RadixTrie, TrieNode
from common.kv.sliding_pages import SlidingPages
from common.kv.sliding_partners import HeldPartners, NoPartners, PartnerPolicy


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, events: KvEventLog | None = None,
                 window: int | None = None, sliding: SlidingPages | None = None,
                 lock: threading.RLock | None = None) -> None:
        """`window`: a hybrid model's largest sliding window ("Partial pages"); `sliding`: its
        sliding group (None: no partners to hold); `lock`: the engine's ("Locking")."""
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.allocator = allocator
        self.events = events
        self.page_size = page_size
        self._lock = lock
        self._trie = RadixTrie(page_size, lambda tail: allocator.refcount(tail.page) == 1, window)
        self._planner = EvictionPlanner(allocator)
        self._partners: PartnerPolicy = NoPartners() if sliding is None else HeldPartners(sliding, allocator)
        self.on_cached: Callable[[int, int | None, tuple[int, ...]], None] | None = None
        self.on_evicted: Callable[[int, int | None, tuple[int, ...], int], None] | None = None

    @property
    def num_cached_pages(self) -> int:
        return self._trie.num_nodes

    def match(self, token_ids: Sequence[int], salt: int = 0) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids`: `(pages, matched_token_count)`.

        The caller owns one reference on each returned page and must decref it when done. When
        the match ends inside a handed-over tail page (the last returned page), that page is the
        caller's alone and `matched_token_count` is not a multiple of the page size. The whole of
        `token_ids` may match: pass only what may be reused (e.g. `prompt[:-1]`).
        """
        self._check_locked()
        path, tail, tail_len = self._trie.lookup(token_ids, salt)
        pages = [n.page for n in path]
        self.allocator.incref(pages)
        if tail is not None:
            self._trie.detach(tail)  # the cache's reference on the page becomes the caller's (no event: a tail)
            pages.append(tail.page)
        self._trie.touch(path)
        return pages, len(path) * self.page_size + tail_len

    def matched_length(self, token_ids: Sequence[int], salt: int = 0) -> int:
        """How many tokens `match` would reuse now, without taking or touching anything."""
        path, _, tail_len = self._trie.lookup(token_ids, salt)
        return len(path) * self.page_size + tail_len

    def partial_before(self, token_ids: Sequence[int], salt: int = 0) -> int:
        """The end of the last partial page among those `match(token_ids)` returns (0: none):
        positions before it may lack some layers' KV."""
        path, tail, _ = self._trie.lookup(token_ids, salt)
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
        self._check_locked()
        keys = self._trie.page_keys(token_ids)
        tail_tokens = tuple(int(t) for t in token_ids[len(keys) * self.page_size :])
        needed = len(keys) + bool(tail_tokens)
        if len(pages) < needed:
            raise ValueError(f"{len(token_ids)} tokens fill {needed} pages but only {len(pages)} pages given")
        path: list[TrieNode] = []
        node = self._trie.root(salt)
        for i, (key, page) in enumerate(zip(keys, pages)):
            partial = i * self.page_size < partial_before
            child = node.children.get(key)
            if child is None:
                # A tail on this very page was recorded while its sequence still filled it.
                self._drop_tails(node, lambda t, page=page: t.page == page)
                child = self._add(node, key, page, partial=partial)
            elif child.partial and not partial:  # the whole page replaces the partial one
                self.allocator.incref([page])
                self._partners.hold(page)
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
        self._trie.touch(path)
        self._publish()

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` cached pages that nobody else references, LRU first (leaves a
        sequence still holds are skipped); returns how many were freed."""
        self._check_locked()
        freed = self._trie.evict_lru(num_pages, lambda node: self.allocator.refcount(node.page) > 1, self._evict_leaf)
        self._publish()
        return freed

    def evictable_pages(self) -> int:
        """How many pages `evict` could free now (`EvictionPlanner.evictable`: O(cached pages))."""
        return len(self._planner.evictable(self._trie.tops()))

    def pages_held_only_here(self) -> int:
        """Cached pages no request holds (free to a request, as vLLM counts free blocks); O(pages)."""
        return sum(self.allocator.refcount(node.page) == 1 for node in self._trie.walk())

    def clear(self) -> None:
        """Drop every cache reference (pages still held by sequences stay allocated)."""
        self._check_locked()
        for node in self._trie.clear():
            self._let_go(node)
        self._publish()

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Allocate `n` pages (continuing page `after`'s run where free: `PageAllocator.allocate`),
        evicting LRU cache pages first if the free list is short. Raises `OutOfPages` (its `free`
        counting evictable pages too) without evicting anything when even evicting every
        evictable page would not be enough."""
        self._check_locked()
        short = n - self.allocator.num_free
        if short > 0:
            evictable = self.evictable_pages()
            if evictable < short:
                raise OutOfPages(n, self.allocator.num_free + evictable)
            self.evict(short)
        return self.allocator.allocate(n, after)

    def allocate_contiguous(self, n: int, after: int | None = None) -> list[int]:
        """`allocate`, except that when no run of `n` free pages exists, the cached pages (with
        what hangs below them) in the cheapest window of `n` free-or-evictable pages go first, so
        the pages come as one run, or as few as can be (eviction_planner.py)."""
        self._check_locked()
        if n > 1 and self.allocator.largest_free_run() < n:
            self._trie.remove_subtrees(self._planner.to_evict_for_run(self._trie.tops(), n), self._evict_leaf)
            self._publish()
        return self.allocate(n, after)

    def page_of(self, block_hash: int) -> int | None:
        """The page holding the whole full block `block_hash`, while the cache records it."""
        return self._trie.whole_page_of(block_hash)

    def evict_for_sliding(self, n: int) -> None:
        """Free up to `n` sliding pages, those of the coldest whole pages only the cache keeps
        (`HeldPartners.give_up`: a full page stays, partial; a tail goes)."""
        self._check_locked()
        self._partners.give_up(self._trie.walk(), n, self._remove_leaf)
        self._publish()

    def _check_locked(self) -> None:
        if self._lock is not None and not self._lock._is_owned():
            raise RuntimeError("the prefix cache is changed without the engine lock held")

    def _add(self, parent: TrieNode, key: tuple[int, ...], page: int, is_tail: bool = False,
             partial: bool = False) -> TrieNode:
        self.allocator.incref([page])
        if not partial:
            self._partners.hold(page)
        node = self._trie.add(parent, key, page, is_tail, partial)
        if self.events is not None and node.is_named():
            self.events.stored(node.block_hash, node.parent_hash, key)
        if not partial:
            self._report_cached(node)
        return node

    def _report_cached(self, node: TrieNode) -> None:
        if self.on_cached is not None and node.is_named():
            self.on_cached(node.block_hash, node.parent_hash, node.key)

    def _evict_leaf(self, node: TrieNode) -> None:
        if self.on_evicted is not None and node.is_named() and not node.partial:
            self.on_evicted(node.block_hash, node.parent_hash, node.key, node.page)
        self._remove_leaf(node)

    def _drop_tails(self, node: TrieNode, which: Callable[[TrieNode], bool]) -> None:
        for tail in [t for t in node.tails.values() if which(t)]:
            self._remove_leaf(tail)

    def _publish(self) -> None:
        if self.events is not None:
            self.events.publish()

    def _remove_leaf(self, node: TrieNode) -> None:
        self._trie.detach(node)
        self._let_go(node)

    def _let_go(self, node: TrieNode) -> None:
        """Stop recording a node the trie forgot: its event, its partner, the cache's reference."""
        if self.events is not None and node.is_named():
            self.events.removed(node.block_hash)
        self._partners.drop(node)
        self.allocator.decref([node.page])
