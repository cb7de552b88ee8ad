"""The page allocator: reference counts, coalescing of free extents, fewest runs per allocation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.page_allocator import OutOfPages, PageAllocator


def runs(pages: list[int]) -> int:
    """Runs of consecutive ids in position order."""
    return sum(1 for i, p in enumerate(pages) if i == 0 or pages[i - 1] + 1 != p)


def fewest_runs(free_lengths: list[int], n: int) -> int:
    """The fewest free runs that hold `n` pages: the largest ones first (independent of the
    allocator's own bookkeeping: computed from the free pages' refcounts)."""
    total, k = 0, 0
    for length in sorted(free_lengths, reverse=True):
        if total >= n:
            break
        total, k = total + length, k + 1
    return k


def free_runs_by_refcount(a: PageAllocator) -> list[tuple[int, int]]:
    free = [p for p in range(a.num_pages) if a.refcount(p) == 0]
    out: list[tuple[int, int]] = []
    for p in free:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def test_fresh_pool_allocates_in_order_and_refuses_too_much():
    a = PageAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfPages) as exc:
        a.allocate(6)
    assert (exc.value.requested, exc.value.free) == (6, 5)
    assert a.num_free == 5 and a.allocate(0) == []


def test_best_fit_keeps_the_large_extent_for_large_requests():
    a = PageAllocator(20)
    pages = a.allocate(20)
    a.decref(pages[2:4])  # a hole of 2
    a.decref(pages[8:18])  # a hole of 10
    assert a.allocate(2) == [2, 3]  # the small hole, not the front of the large one
    assert a.allocate(10) == list(range(8, 18))


def test_freed_neighbours_coalesce_into_one_run():
    a = PageAllocator(12)
    pages = a.allocate(12)
    for p in (5, 3, 4, 7, 6):  # freed out of order
        a.decref([p])
    assert a.free_extents() == [(3, 5)]
    assert a.allocate(5) == [3, 4, 5, 6, 7]


def test_a_request_no_extent_holds_takes_the_largest_runs():
    a = PageAllocator(30)
    pages = a.allocate(30)
    for lo, hi in ((0, 2), (5, 12), (15, 18), (20, 29)):  # free runs of 2, 7, 3, 9
        a.decref(pages[lo:hi])
    got = a.allocate(14)  # 9 + 5 of the 7: two runs
    assert runs(got) == 2 and got[:9] == list(range(20, 29)) and len(set(got)) == 14


def test_after_continues_the_run_of_a_growing_sequence():
    a = PageAllocator(16)
    first = a.allocate(4)
    other = a.allocate(2)
    a.decref(other)  # pages 4, 5 free again, coalesced with 6..15
    small = a.allocate(1)  # best fit: from the one extent, page 4
    a.decref(small)
    grown = a.allocate(3, after=first[-1])
    assert grown == [4, 5, 6]


def test_refcounts_and_double_free():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.incref(pages)
    assert a.decref(pages) == [] and a.num_free == 2
    assert a.decref(pages) == pages and a.num_free == 4
    with pytest.raises(ValueError):
        a.decref([pages[0]])
    with pytest.raises(ValueError):
        a.incref([3])


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 64),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 10**6)), max_size=60))
def test_random_churn_keeps_extents_exact_and_allocations_in_fewest_runs(num_pages, ops):
    a = PageAllocator(num_pages)
    held: list[list[int]] = []
    for alloc, n, pick in ops:
        if alloc or not held:
            free = free_runs_by_refcount(a)
            assert a.free_extents() == free  # maximal, coalesced, exactly the unreferenced pages
            if n > a.num_free:
                with pytest.raises(OutOfPages):
                    a.allocate(n)
                continue
            after = held[pick % len(held)][-1] if held and held[pick % len(held)] and pick % 2 else None
            got = a.allocate(n, after=after)
            assert len(got) == n == len(set(got)) and all(a.refcount(p) == 1 for p in got)
            if after is None:
                assert runs(got) == fewest_runs([length for _, length in free], n)
            elif n and (after + 1) in dict(free):
                assert got[0] == after + 1
            held.append(got)
        else:
            pages = held.pop(pick % len(held))
            assert sorted(a.decref(pages)) == sorted(pages)
    assert a.num_free == sum(1 for p in range(num_pages) if a.refcount(p) == 0)
    assert a.free_extents() == free_runs_by_refcount(a)
