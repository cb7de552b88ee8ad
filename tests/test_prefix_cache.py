"""The radix prefix cache: page-granular matching, exact refcounts, LRU eviction, allocate()."""
from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.page_allocator import OutOfPages, PageAllocator
from common.prefix_cache import PrefixCache

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


def test_match_returns_only_whole_pages() -> None:
    allocator, cache = make()
    tokens = list(range(10))
    pages = run_sequence(cache, tokens)
    cache.insert(tokens, pages)
    assert cache.num_cached_pages == 2  # the partial third page is not recorded

    assert cache.match(tokens[:3]) == ([], 0)
    assert cache.match(tokens[:7]) == (pages[:1], 4)
    assert cache.match(tokens) == (pages[:2], 8)
    assert cache.match([99] + tokens[1:]) == ([], 0)
    # The sequence, the cache, and the two matches above that returned page 0.
    assert [allocator.refcount(p) for p in pages] == [4, 3, 1]


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
    assert [allocator.refcount(p) for p in b[2:]] == [2, 1]

    allocator.decref(a)
    allocator.decref(b)
    assert cache.num_cached_pages == 4
    assert allocator.num_free == 16 - 4
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


def test_insert_needs_a_page_per_full_page_of_tokens() -> None:
    _, cache = make()
    with pytest.raises(ValueError, match="2 full pages of tokens but only 1 pages given"):
        cache.insert(list(range(9)), cache.allocate(1))


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
    assert len(cache._heap) <= 2 * cache.num_cached_pages + 64 + 1


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random traffic against a reference model of the cache.

    The model is a dict from cached token prefix (whole pages) to `[page, last_touch]`; it
    predicts matches, LRU eviction order and allocate()'s evictions. Every page's refcount must
    equal its live holders plus one if cached, and every matched page must hold the KV of
    exactly the matched prefix (tracked as `content`, rewritten whenever a page is reused).
    """

    NUM_PAGES = 10
    PS = 2

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(self.NUM_PAGES)
        self.cache = PrefixCache(self.allocator, self.PS)
        self.model: dict[tuple[int, ...], list[int]] = {}
        self.clock = 0
        self.live: list[tuple[list[int], list[int]]] = []  # (tokens, page table) per sequence
        self.content: dict[int, tuple[int, ...]] = {}

    # --- model -----------------------------------------------------------------------------
    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:k]) for k in range(self.PS, len(tokens) + 1, self.PS)]

    def touch(self, keys: list[tuple[int, ...]]) -> None:
        self.clock += 1
        for key in keys:
            self.model[key][1] = self.clock

    def is_leaf(self, key: tuple[int, ...]) -> bool:
        return not any(len(k) == len(key) + self.PS and k[: len(key)] == key for k in self.model)

    def model_evictable(self) -> int:
        return sum(
            all(
                self.allocator.refcount(page) == 1
                for k, (page, _) in self.model.items()
                if k[: len(key)] == key
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
        pages, matched = self.cache.match(tokens)
        assert pages == [self.model[k][0] for k in expected]
        assert matched == len(pages) * self.PS
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(tokens[: (i + 1) * self.PS])
        if expected:
            self.touch(expected)
        return pages

    @rule(tokens=st.lists(st.integers(0, 1), max_size=7))
    def match_then_abort(self, tokens: list[int]) -> None:
        self.allocator.decref(self.checked_match(tokens))

    @rule(tokens=st.lists(st.integers(0, 1), max_size=7))
    def add_sequence(self, tokens: list[int]) -> None:
        pages = self.checked_match(tokens)
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
        for i in range(len(pages), len(table)):
            self.content[table[i]] = tuple(tokens[: (i + 1) * self.PS])
        self.live.append((tokens, table))

    def record(self, tokens: list[int], table: list[int]) -> None:
        keys = self.prefixes(tokens)
        for key, page in zip(keys, table):
            self.model.setdefault(key, [page, 0])
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

    def teardown(self) -> None:
        for _, table in self.live:
            self.allocator.decref(table)
        self.cache.clear()
        assert self.allocator.num_free == self.NUM_PAGES


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
