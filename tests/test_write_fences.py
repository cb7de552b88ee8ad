"""WriteFences (decode_node/write_fences.py): the pins that keep a one-sided writer's pages out
of circulation, checked against the allocator's reference counts."""
from __future__ import annotations

import time

from common.kv.page_allocator import PageAllocator
from decode_node.write_fences import WriteFences


def _setup() -> tuple[PageAllocator, WriteFences, list[int]]:
    allocator = PageAllocator(8)
    return allocator, WriteFences(allocator, quarantine_seconds=30.0), allocator.allocate(3)


def test_pages_outlive_their_reservation_until_the_writer_reports():
    allocator, fences, pages = _setup()
    fences.pin("r1", 7, pages)
    allocator.decref(pages)  # the reservation expires
    assert allocator.num_free == 5, "a fenced page went back to the free list"
    assert fences.quarantined_pages(lambda rid, nonce: False) == 3
    assert not fences.unpin("r1", 8), "a wrong nonce must not lift the fence"
    assert fences.unpin("r1", 7)
    assert allocator.num_free == 8 and fences.quarantined_pages(lambda rid, nonce: False) == 0
    assert not fences.unpin("r1", 7), "a fence comes down once"


def test_live_reservations_are_not_counted_as_quarantined():
    _, fences, pages = _setup()
    fences.pin("r1", 7, pages)
    assert fences.quarantined_pages(lambda rid, nonce: (rid, nonce) == ("r1", 7)) == 0


def test_each_writer_holds_its_own_pin():
    allocator, fences, pages = _setup()
    fences.pin("r1", 7, pages)
    fences.pin("r1", 7, pages)  # a retried writer
    assert [allocator.refcount(p) for p in pages] == [3, 3, 3]
    fences.unpin("r1", 7)
    assert [allocator.refcount(p) for p in pages] == [2, 2, 2]


def test_a_silent_writer_is_released_after_the_quarantine():
    allocator, fences, pages = _setup()
    fences.pin("r1", 7, pages)
    allocator.decref(pages)
    assert fences.expire_due(time.monotonic()) == 0
    assert fences.expire_due(time.monotonic() + 31) == 1
    assert allocator.num_free == 8


def test_release_all_drops_every_pin():
    allocator, fences, pages = _setup()
    fences.pin("r1", 7, pages[:1])
    fences.pin("r2", 9, pages[1:])
    allocator.decref(pages)
    fences.release_all()
    assert allocator.num_free == 8
