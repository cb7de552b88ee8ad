"""The radix prefix cache: shared full pages, handed-over tail pages, exact refcounts, LRU eviction,
allocate()."""
from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.kv.block_hashes import block_hashes
from common.kv.events import KvEventLog
from common.kv.eviction_planner import spans_to_free
from common.kv.page_allocator import OutOfPages, PageAllocator
from common.kv.prefix_cache import PrefixCache

PS = 4


def make(num_pages: int = 16) -> tuple[PageAllocator, PrefixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, PrefixCache(allocator, PS)


def run_sequence(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """What a scheduler does for a new sequence: reuse the cached prefix, allocate the rest."""
    pages, _ = cache.match(tokens)
    return pages + cache.allocate(math.ceil(len(tokens) / PS) - len(pages))


def cache_only(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Compute and cache `tokens`, then finish the sequence: its pages stay only in the cache."""
    pages = run_sequence(cache, tokens)
    cache.insert(tokens, pages)
    cache.allocator.decref(pages)
    return pages


def test_match_shares_whole_pages_but_not_a_tail_its_sequence_still_holds() -> None:
    allocator, cache = make()
    tokens = list(range(10))
    pages = run_sequence(cache, tokens)
    cache.insert(tokens, pages)
    assert cache.num_cached_pages == 3  # two full pages and the partial third one, as a tail

    assert cache.match(tokens[:3]) == ([], 0)
    assert cache.match(tokens[:7]) == (pages[:1], 4)
    assert cache.match(tokens) == (pages[:2], 8)  # the tail's sequence still holds it
    assert cache.match([99] + tokens[1:]) == ([], 0)
    # The sequence, the cache, and the two matches above that returned page 0.
    assert [allocator.refcount(p) for p in pages] == [4, 3, 2]


def test_partial_pages_serve_only_matches_whose_window_stays_clear_of_them() -> None:
    """A hybrid model's hand-off leaves pages whose sliding layers lack KV (positions before 24
    here, window 8): a match may end only where the window of its first computed position
    reads whole pages; a whole copy of the same tokens replaces the partial pages."""
    allocator = PageAllocator(32)
    cache = PrefixCache(allocator, PS, window=8)
    tokens = list(range(100, 140))
    pages = allocator.allocate(10)
    cache.insert(tokens, pages, partial_before=24)  # pages 0-5 partial
    allocator.decref(pages)
    assert cache.matched_length(tokens) == 40  # reads positions 33-39: pages 8 and 9
    assert cache.matched_length(tokens[:33]) == 32  # 26-31: page 6 and 7, whole
    assert cache.matched_length(tokens[:30]) == 0  # 23-29 reach page 5, and every shorter match earlier pages
    assert cache.partial_before(tokens) == 24 and cache.partial_before(tokens[:30]) == 0
    shorter, n = cache.match(tokens[:30])
    assert (shorter, n) == ([], 0)
    assert PrefixCache(allocator, PS).matched_length(tokens[:30]) == 0  # an empty cache: nothing
    whole = allocator.allocate(8)
    cache.insert(tokens[:32], whole)  # the same tokens computed here: every layer's KV
    allocator.decref(whole)
    # The partial pages went back; of the whole ones, the cache kept its own (pages 6 and 7).
    assert [allocator.refcount(p) for p in pages[:8]] == [0] * 6 + [1, 1]
    assert [allocator.refcount(p) for p in whole] == [1] * 6 + [0, 0]
    assert cache.matched_length(tokens[:30]) == 28 and cache.partial_before(tokens) == 0


def test_without_a_window_partial_pages_are_served_and_a_partial_tail_is_not_recorded() -> None:
    allocator, cache = make()
    tokens = list(range(10))
    pages = allocator.allocate(3)
    cache.insert(tokens, pages, partial_before=10)
    allocator.decref(pages)
    assert cache.num_cached_pages == 2 and cache.matched_length(tokens) == 8  # the tail was not recorded


def test_a_salted_tree_serves_only_its_own_salt_and_is_named_to_nobody() -> None:
    """Longrope's long-factor K/V (salt 1) and the same tokens' short-factor K/V (salt 0) are
    different pages: each prompt finds only its own. Salted pages are not reported as events nor
    to the tier (others name blocks unsalted), and are evicted and cleared like any other."""
    allocator = PageAllocator(16)
    events = KvEventLog(PS)
    cache = PrefixCache(allocator, PS, events)
    told: list[int] = []
    cache.on_cached = lambda block_hash, parent, tokens: told.append(block_hash)
    tokens = list(range(10))
    long_pages = allocator.allocate(3)
    cache.insert(tokens, long_pages, salt=1)
    allocator.decref(long_pages)
    assert cache.matched_length(tokens) == 0 and cache.match(tokens) == ([], 0)
    assert cache.matched_length(tokens, salt=1) == 10 and events.snapshot()[1] == [] and told == []
    short_pages = cache_only(cache, tokens)  # the same tokens, unsalted: other pages
    assert not set(short_pages) & set(long_pages)
    assert cache.match(tokens, salt=1) == (long_pages, 10)  # the tail is handed over
    assert cache.match(tokens[:8]) == (short_pages[:2], 8)
    assert events.snapshot()[1] == told == block_hashes(tokens, PS)
    allocator.decref(long_pages + short_pages[:2])
    assert cache.evict(16) == 5 and allocator.num_free == 16  # 2 + 1 unsalted (a tail), 2 salted
    cache_only(cache, tokens)
    cache.insert(tokens, cache.allocate(3), salt=1)
    cache.clear()
    assert cache.num_cached_pages == 0 and cache.matched_length(tokens, salt=1) == 0


def test_match_accepts_any_int_sequence() -> None:
    np = pytest.importorskip("numpy")
    _, cache = make()
    pages = cache_only(cache, list(range(8)))
    assert cache.match(np.arange(9)) == (pages, 8)
    assert cache.match(tuple(range(8))) == (pages, 8)


def test_refcounts_exact_and_nothing_leaks() -> None:
    allocator, cache = make()
    a = run_sequence(cache, list(range(12)))
    cache.insert(list(range(12)), a)
    b = run_sequence(cache, list(range(8)) + [50, 51, 52, 53, 54])  # shares 2 pages with a
    assert b[:2] == a[:2]
    cache.insert(list(range(8)) + [50, 51, 52, 53, 54], b)
    assert [allocator.refcount(p) for p in a] == [3, 3, 2]
    assert [allocator.refcount(p) for p in b[2:]] == [2, 2]  # a full page and b's tail

    allocator.decref(a)
    allocator.decref(b)
    assert cache.num_cached_pages == 5
    assert allocator.num_free == 16 - 5
    cache.clear()
    assert cache.num_cached_pages == 0
    assert allocator.num_free == 16


def test_duplicate_insert_keeps_existing_page() -> None:
    allocator, cache = make()
    tokens = list(range(8))
    first = run_sequence(cache, tokens)
    second = run_sequence(cache, tokens)  # computed concurrently: nothing cached yet
    assert set(first).isdisjoint(second)
    cache.insert(tokens, first)
    cache.insert(tokens, second)
    assert cache.num_cached_pages == 2
    assert [allocator.refcount(p) for p in first] == [2, 2]
    assert [allocator.refcount(p) for p in second] == [1, 1]
    assert cache.match(tokens)[0] == first

    # A longer duplicate extends the existing path with its own new pages.
    longer = run_sequence(cache, tokens + [8, 9, 10, 11])
    cache.insert(tokens + [8, 9, 10, 11], second + longer[2:])
    assert cache.num_cached_pages == 3
    assert cache.match(tokens + [8, 9, 10, 11])[0] == first + longer[2:]
    assert [allocator.refcount(p) for p in second] == [1, 1]


def test_insert_needs_a_page_per_page_of_tokens() -> None:
    _, cache = make()
    with pytest.raises(ValueError, match="9 tokens fill 3 pages but only 2 pages given"):
        cache.insert(list(range(9)), cache.allocate(2))


def test_tail_page_is_handed_over_to_a_prompt_that_extends_the_sequence() -> None:
    allocator, cache = make()
    tokens = list(range(10))
    pages = cache_only(cache, tokens)
    assert cache.matched_length(tokens + [10, 11]) == 10  # a look, which takes nothing
    assert cache.num_cached_pages == 3

    got, matched = cache.match(tokens + [10, 11])
    assert (got, matched) == (pages, 10)
    assert cache.num_cached_pages == 2  # the tail now belongs to the caller alone
    assert [allocator.refcount(p) for p in pages] == [2, 2, 1]
    allocator.decref(got)
    assert allocator.refcount(pages[2]) == 0 and cache.match(tokens) == (pages[:2], 8)


def test_tokens_past_the_match_in_a_tail_are_popped() -> None:
    _, cache = make()
    pages = cache_only(cache, list(range(11)))  # tail holds tokens 8, 9, 10
    assert cache.match(list(range(9)) + [77, 78]) == (pages, 9)  # slots of 9, 10 get overwritten


def test_a_tail_that_matches_nothing_stays_cached() -> None:
    _, cache = make()
    pages = cache_only(cache, list(range(10)))
    assert cache.match(list(range(8)) + [77]) == (pages[:2], 8)
    assert cache.num_cached_pages == 3


def test_the_longest_matching_tail_is_chosen() -> None:
    _, cache = make()
    short = cache_only(cache, list(range(4)) + [5])
    long = cache_only(cache, list(range(4)) + [6, 7, 8])
    assert cache.num_cached_pages == 3  # one full page shared by two tails
    assert cache.match(list(range(4)) + [6, 7]) == (long, 6)
    assert cache.match(list(range(4)) + [5, 5]) == (short, 5)


def test_insert_keeps_one_tail_per_run_of_tokens() -> None:
    allocator, cache = make()
    first = cache_only(cache, list(range(6)))

    def insert_with_a_new_tail_page(tokens: list[int]) -> int:
        """Like a sequence that computed `tokens` without taking the cached tail."""
        shared, _ = cache.match(tokens[:PS])
        tail = cache.allocate(1)
        cache.insert(tokens, shared + tail)
        allocator.decref(shared + tail)
        return tail[0]

    covered = insert_with_a_new_tail_page(list(range(5)))  # the cached tail holds 4, 5 already
    assert allocator.refcount(covered) == 0 and allocator.refcount(first[1]) == 1
    longer = insert_with_a_new_tail_page(list(range(7)))  # extends the cached tail: replaces it
    assert allocator.refcount(first[1]) == 0 and allocator.refcount(longer) == 1
    assert cache.num_cached_pages == 2 and cache.match(list(range(8)))[0] == [first[0], longer]


def test_tails_are_evicted_lru_before_their_parent() -> None:
    allocator, cache = make()
    pages = cache_only(cache, list(range(6)))
    other = cache_only(cache, [9] * PS)
    assert cache.evictable_pages() == 3
    assert cache.evict(1) == 1 and allocator.refcount(pages[1]) == 0  # the tail, oldest leaf
    assert cache.evict(1) == 1 and allocator.refcount(pages[0]) == 0  # then the page it hung from
    assert allocator.refcount(other[0]) == 1


def test_a_held_tail_protects_its_parent() -> None:
    allocator, cache = make()
    pages = cache_only(cache, list(range(6)))
    allocator.incref([pages[1]])
    assert cache.evictable_pages() == 0 and cache.evict(2) == 0
    allocator.decref([pages[1]])
    assert cache.evict(2) == 2 and allocator.num_free == 16


def test_evict_is_lru() -> None:
    allocator, cache = make()
    a = cache_only(cache, [1] * PS)
    b = cache_only(cache, [2] * PS)
    c = cache_only(cache, [3] * PS)
    allocator.decref(cache.match([1] * PS)[0])  # a is now the most recently used

    assert cache.evict(1) == 1
    assert allocator.refcount(b[0]) == 0
    assert cache.evict(1) == 1
    assert allocator.refcount(c[0]) == 0
    assert cache.match([1] * PS)[0] == a


def test_insert_touches_the_path() -> None:
    allocator, cache = make()
    cache_only(cache, [1] * PS)
    b = cache_only(cache, [2] * PS)
    held = cache.match([1] * PS)[0]
    cache.insert([1] * PS, held)  # re-inserting a cached path touches it too
    allocator.decref(held)
    assert cache.evict(1) == 1
    assert allocator.refcount(b[0]) == 0


def test_evict_cascades_from_the_leaf() -> None:
    allocator, cache = make()
    tokens = list(range(3 * PS))
    pages = cache_only(cache, tokens)
    assert cache.evict(1) == 1
    assert allocator.refcount(pages[2]) == 0
    matched, n = cache.match(tokens)
    assert (matched, n) == (pages[:2], 2 * PS)
    allocator.decref(matched)
    assert cache.evict(10) == 2
    assert cache.num_cached_pages == 0 and allocator.num_free == 16


def test_evict_never_frees_a_page_a_sequence_holds() -> None:
    allocator, cache = make()
    old = list(range(2 * PS))
    live_pages = run_sequence(cache, old)
    cache.insert(old, live_pages)  # oldest entry, but still referenced by its sequence
    newer = cache_only(cache, [7] * PS)

    assert cache.evictable_pages() == 1
    assert cache.evict(5) == 1
    assert allocator.refcount(newer[0]) == 0
    assert [allocator.refcount(p) for p in live_pages] == [2, 2]
    assert cache.evict(5) == 0

    allocator.decref(live_pages)
    assert cache.evictable_pages() == 2
    assert cache.evict(5) == 2


def test_a_held_leaf_protects_its_ancestors() -> None:
    allocator, cache = make()
    pages = cache_only(cache, list(range(3 * PS)))
    allocator.incref([pages[2]])  # someone holds only the last page
    assert cache.evictable_pages() == 0
    assert cache.evict(3) == 0
    allocator.decref([pages[2]])
    assert cache.evictable_pages() == 3


def test_allocate_evicts_lru_only_what_it_needs() -> None:
    allocator, cache = make(num_pages=4)
    a = cache_only(cache, [1] * PS)
    b = cache_only(cache, [2] * PS)
    c = cache_only(cache, [3] * PS)
    assert allocator.num_free == 1

    got = cache.allocate(3)
    assert cache.num_cached_pages == 1
    assert allocator.refcount(c[0]) == 1  # the most recent entry survives
    assert sorted(got) == sorted(a + b + [p for p in range(4) if p not in a + b + c])


def test_allocate_raises_without_evicting_when_it_cannot_succeed() -> None:
    allocator, cache = make(num_pages=4)
    cache_only(cache, [1] * PS)
    cache_only(cache, [2] * PS)
    held = run_sequence(cache, [3] * PS)
    cache.insert([3] * PS, held)
    extra = cache.allocate(1)
    assert allocator.num_free == 0

    with pytest.raises(OutOfPages) as err:
        cache.allocate(3)
    assert (err.value.requested, err.value.free) == (3, 2)
    assert cache.num_cached_pages == 3
    allocator.decref(held + extra)
    assert len(cache.allocate(4)) == 4


def test_clear_keeps_pages_sequences_hold() -> None:
    allocator, cache = make()
    pages = run_sequence(cache, list(range(2 * PS)))
    cache.insert(list(range(2 * PS)), pages)
    cache.clear()
    assert [allocator.refcount(p) for p in pages] == [1, 1]
    assert cache.match(list(range(2 * PS))) == ([], 0)
    allocator.decref(pages)
    assert allocator.num_free == 16


def test_lru_bookkeeping_stays_bounded_under_repeated_hits() -> None:
    allocator, cache = make()
    cache_only(cache, list(range(2 * PS)))
    for _ in range(1000):
        allocator.decref(cache.match(list(range(2 * PS)))[0])
    assert len(cache._trie._heap) <= 2 * cache.num_cached_pages + 64 + 1


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random traffic against a reference model of the cache.

    The model is a dict from cached token prefix to `[page, last_touch]`: whole pages, and tails
    (a prefix whose length is not a multiple of the page size); it predicts matches, tail
    hand-overs, LRU eviction order and allocate()'s evictions. Every page's refcount must equal
    its live holders plus one if cached, and every matched page must hold the KV of exactly the
    matched prefix (tracked as `content`, rewritten whenever a page is reused).
    """

    NUM_PAGES = 10
    PS = 3

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(self.NUM_PAGES)
        # A short history, so the watcher below also has to fall back to snapshots.
        self.events = KvEventLog(self.PS, history=3)
        self.cache = PrefixCache(self.allocator, self.PS, self.events)
        self.watched: set[int] = set()  # what a watcher following self.events believes is cached
        self.watch_cursor = 0
        self.model: dict[tuple[int, ...], list[int]] = {}
        self.clock = 0
        self.live: list[tuple[list[int], list[int]]] = []  # (tokens, page table) per sequence
        self.content: dict[int, tuple[int, ...]] = {}

    # --- model -----------------------------------------------------------------------------
    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:k]) for k in range(self.PS, len(tokens) + 1, self.PS)]

    def is_tail(self, key: tuple[int, ...]) -> bool:
        return len(key) % self.PS != 0

    def parent(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[: (len(key) - 1) // self.PS * self.PS]

    def tails_at(self, base: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [k for k in self.model if self.is_tail(k) and self.parent(k) == base]

    def in_subtree(self, k: tuple[int, ...], key: tuple[int, ...]) -> bool:
        return k == key or (not self.is_tail(key) and len(k) > len(key) and k[: len(key)] == key)

    def touch(self, keys: list[tuple[int, ...]]) -> None:
        self.clock += 1
        for key in keys:
            self.model[key][1] = self.clock

    def is_leaf(self, key: tuple[int, ...]) -> bool:
        return not any(k != key and self.parent(k) == key for k in self.model)

    def model_evictable(self) -> int:
        return sum(
            all(
                self.allocator.refcount(page) == 1
                for k, (page, _) in self.model.items()
                if self.in_subtree(k, key)
            )
            for key in self.model
        )

    def model_evict(self, n: int) -> int:
        freed = 0
        while freed < n:
            candidates = [
                (touched, key)
                for key, (page, touched) in self.model.items()
                if self.is_leaf(key) and self.allocator.refcount(page) == 1
            ]
            if not candidates:
                break
            del self.model[min(candidates)[1]]
            freed += 1
        return freed

    def cached_pages(self) -> set[int]:
        return {page for page, _ in self.model.values()}

    # --- rules -----------------------------------------------------------------------------
    def checked_match(self, tokens: list[int]) -> list[int]:
        expected = []
        for key in self.prefixes(tokens):
            if key not in self.model:
                break
            expected.append(key)
        base = len(expected) * self.PS
        rest = tokens[base : base + self.PS - 1]
        best = 0
        lengths = {}
        for k in self.tails_at(tuple(tokens[:base])):
            n = next((i for i, (a, b) in enumerate(zip(k[base:], rest)) if a != b), min(len(k) - base, len(rest)))
            if self.allocator.refcount(self.model[k][0]) == 1:
                lengths[k] = n
                best = max(best, n)
        pages, matched = self.cache.match(tokens)
        assert pages[: len(expected)] == [self.model[k][0] for k in expected]
        assert matched == base + best
        if best:  # one of the best tails was handed over
            assert len(pages) == len(expected) + 1
            taken = next(k for k, n in lengths.items() if n == best and self.model[k][0] == pages[-1])
            del self.model[taken]
            assert self.content[pages[-1]][:matched] == tuple(tokens[:matched])
        else:
            assert len(pages) == len(expected)
        for i, page in enumerate(pages[: len(expected)]):
            assert self.content[page] == tuple(tokens[: (i + 1) * self.PS])
        if expected:
            self.touch(expected)
        return pages, matched

    @rule(tokens=st.lists(st.integers(0, 1), max_size=8))
    def match_then_abort(self, tokens: list[int]) -> None:
        self.allocator.decref(self.checked_match(tokens)[0])

    @rule(tokens=st.lists(st.integers(0, 1), max_size=8))
    def add_sequence(self, tokens: list[int]) -> None:
        self.start_sequence(tokens)

    @precondition(lambda self: any(self.is_tail(k) for k in self.model))
    @rule(data=st.data())
    def extend_a_cached_tail(self, data: st.DataObject) -> None:
        """A prompt that continues a cached sequence, or agrees with part of its tail."""
        key = data.draw(st.sampled_from(sorted(k for k in self.model if self.is_tail(k))))
        cut = data.draw(st.integers(len(self.parent(key)) + 1, len(key)))
        self.start_sequence(list(key[:cut]) + data.draw(st.lists(st.integers(0, 1), max_size=3)))

    def start_sequence(self, tokens: list[int]) -> None:
        pages, matched = self.checked_match(tokens)
        need = math.ceil(len(tokens) / self.PS) - len(pages)
        short = need - self.allocator.num_free
        if short > 0 and self.model_evictable() < short:
            with pytest.raises(OutOfPages):
                self.cache.allocate(need)
            self.allocator.decref(pages)
            return
        if short > 0:
            self.model_evict(short)
        table = pages + self.cache.allocate(need)
        for i in range(matched // self.PS, len(table)):  # pages this sequence (re)writes
            self.content[table[i]] = tuple(tokens[: (i + 1) * self.PS])
        self.live.append((tokens, table))

    def record(self, tokens: list[int], table: list[int]) -> None:
        keys = self.prefixes(tokens)
        for key, page in zip(keys, table):
            if key not in self.model:
                for stale in [k for k in self.tails_at(self.parent(key)) if self.model[k][0] == page]:
                    del self.model[stale]
                self.model[key] = [page, 0]
        tail = tuple(tokens)
        if self.is_tail(tail):
            base = self.parent(tail)
            covering = [k for k in self.tails_at(base) if k[: len(tail)] == tail]
            if covering:
                tail = covering[0]
            else:
                for extended in [k for k in self.tails_at(base) if tail[: len(k)] == k]:
                    del self.model[extended]
                self.model[tail] = [table[len(keys)], 0]
            keys.append(tail)
        if keys:
            self.touch(keys)
        self.cache.insert(tokens, table)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        """Insert while the sequence still runs (e.g. when its prefill completes)."""
        self.record(*data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data: st.DataObject, cache_it: bool) -> None:
        tokens, table = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        if cache_it:
            self.record(tokens, table)
        self.allocator.decref(table)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def hold_one_page(self, data: st.DataObject) -> None:
        """Someone holds a single cached page (possibly a leaf whose ancestors nobody holds)."""
        page = data.draw(st.sampled_from(sorted(self.cached_pages())))
        self.allocator.incref([page])
        self.live.append(([], [page]))

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        expected = self.model_evict(n)
        assert self.cache.evict(n) == expected

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def refcounts_are_exact(self) -> None:
        holders = [0] * self.NUM_PAGES
        for _, table in self.live:
            for page in table:
                holders[page] += 1
        cached = self.cached_pages()
        assert len(cached) == len(self.model) == self.cache.num_cached_pages
        expected = [holders[page] + (page in cached) for page in range(self.NUM_PAGES)]
        assert [self.allocator.refcount(page) for page in range(self.NUM_PAGES)] == expected
        assert self.allocator.num_free == expected.count(0)

    @invariant()
    def evictable_count_matches(self) -> None:
        assert self.cache.evictable_pages() == self.model_evictable()

    @invariant()
    def kv_events_name_exactly_the_cached_full_pages(self) -> None:
        changes = self.events.changes_after(self.watch_cursor)
        if changes is None:
            self.watch_cursor, blocks = self.events.snapshot()
            self.watched = set(blocks)
        for change in changes or ():
            self.watched.difference_update(change.removed)
            self.watched.update(change.stored)
            self.watch_cursor = change.sequence
        full = {block_hashes(key, self.PS)[-1] for key in self.model if not self.is_tail(key)}
        assert self.watched == full and self.events.num_blocks == len(full)

    def teardown(self) -> None:
        for _, table in self.live:
            self.allocator.decref(table)
        self.cache.clear()
        assert self.allocator.num_free == self.NUM_PAGES


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)


def cache_page(cache: PrefixCache, token: int, page: int) -> None:
    """Hand a page this test holds to the cache as one full page of `token`s, cache-only."""
    cache.insert([token] * PS, [page])
    cache.allocator.decref([page])


def test_allocate_contiguous_evicts_a_window_to_give_one_run() -> None:
    """Free pages 0, 4, 8 (no run of 3) between cached and held pages: the three pages come as
    one run, freed by evicting the least recently used cached pages that make one; pages a
    sequence holds are never taken."""
    allocator, cache = make(num_pages=9)
    assert cache.allocate(9) == list(range(9))
    for token, page in ((1, 1), (2, 2), (3, 5), (4, 6)):  # cached, oldest first
        cache_page(cache, token, page)
    allocator.decref([0, 4, 8])  # free; 3 and 7 stay held by a sequence
    assert cache.allocate_contiguous(3) == [0, 1, 2]
    assert cache.num_cached_pages == 2 and all(allocator.refcount(p) == 1 for p in (3, 5, 6, 7))
    assert cache.matched_length([3] * PS + [0]) == PS  # the more recent entries survive


def test_allocate_contiguous_takes_the_fewest_runs_when_no_window_exists() -> None:
    allocator, cache = make(num_pages=8)
    assert cache.allocate(8) == list(range(8))
    for token, page in ((1, 0), (2, 3), (3, 4), (4, 6)):
        cache_page(cache, token, page)
    allocator.decref([5])  # runs of free or cached pages: [0], [3, 4, 5], [6]; 1, 2, 7 held
    got = cache.allocate_contiguous(4)
    assert sorted(got) == [0, 3, 4, 5] or sorted(got) == [3, 4, 5, 6]  # two runs, not three
    assert all(allocator.refcount(p) == 1 for p in (1, 2, 7))


def test_the_planner_frees_the_least_recent_window_then_the_one_evicting_fewest() -> None:
    allocator = PageAllocator(8)
    allocator.allocate(8)
    allocator.decref([7])  # free; 2, 3 and 4 stay held
    assert spans_to_free(allocator, {0: 3, 1: 3, 5: 3, 6: 3}, 2) == [(6, 2)]  # one eviction, not two
    assert spans_to_free(allocator, {0: 1, 1: 1, 5: 3, 6: 3}, 2) == [(0, 2)]  # older K/V, though two
    assert spans_to_free(allocator, {0: 1}, 3) == []  # three free or evictable pages do not exist


def test_a_cache_given_the_engine_lock_is_changed_only_by_its_holder() -> None:
    lock = threading.RLock()
    cache = PrefixCache(PageAllocator(4), PS, lock=lock)
    with pytest.raises(RuntimeError, match="engine lock"):
        cache.allocate(1)
    with lock:
        pages = cache.allocate(1)
        cache.insert(list(range(PS)), pages)
    with lock, ThreadPoolExecutor(1) as other:  # held here: another thread is refused
        assert isinstance(other.submit(cache.clear).exception(), RuntimeError)
    assert cache.num_cached_pages == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 2), st.integers(0, 10**6)), max_size=40))
def test_allocate_contiguous_gives_one_run_whenever_free_and_cache_only_pages_make_one(ops) -> None:
    """Sequences of 1-6 pages come and go; a finished one is freed or cached page by page (each a
    cache-only leaf). Whenever `n` consecutive pages are free or cache-only, a reservation of `n`
    is one run, and it never takes a page a live sequence holds."""
    allocator, cache = make(num_pages=24)
    live: list[list[int]] = []
    token = itertools.count(1000)
    for n, action, pick in ops:
        if action == 0 or not live:
            takeable = [allocator.refcount(p) == 0 or
                        (allocator.refcount(p) == 1 and p not in {q for s in live for q in s}) for p in range(24)]
            window = any(all(takeable[i : i + n]) for i in range(24 - n + 1))
            held = {q for s in live for q in s}
            try:
                got = cache.allocate_contiguous(n)
            except OutOfPages:
                assert sum(takeable) < n
                continue
            assert len(set(got)) == n and not set(got) & held and all(allocator.refcount(p) == 1 for p in got)
            runs = [sum(1 for _ in group) for ok, group in itertools.groupby(takeable) if ok]
            fewest = next(k for k in range(1, len(runs) + 1) if sum(sorted(runs, reverse=True)[:k]) >= n)
            assert sum(1 for i, p in enumerate(got) if i == 0 or got[i - 1] + 1 != p) == fewest, got
            if window:
                assert got == list(range(got[0], got[0] + n)), got
            live.append(got)
        else:
            seq = live.pop(pick % len(live))
            if action == 2:
                for p in seq:
                    cache.insert([next(token)] * PS, [p])
            allocator.decref(seq)
    assert cache.num_cached_pages == sum(1 for p in range(24) if allocator.refcount(p) == 1) - sum(map(len, live))
