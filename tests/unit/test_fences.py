"""WriteFences (common/transports/fences.py): the pins that keep a writer's pages out of
circulation, checked against the allocator's reference counts."""
from __future__ import annotations

import threading
import time

from common.kv.page_allocator import PageAllocator
from common.kv.segments import Placement, Segments
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences


def _setup(alive: bool = False) -> tuple[PageAllocator, WriteFences, WriteWindow]:
    allocator = PageAllocator(8)
    pages = tuple(allocator.allocate(3))
    window = WriteWindow("r1", 7, Placement(Segments(((0, 12),))), pages, alive=lambda: alive)
    return allocator, WriteFences(allocator, threading.RLock(), quarantine_seconds=30.0), window


def test_pages_outlive_their_reservation_until_the_writer_reports():
    allocator, fences, window = _setup()
    fences.raise_fence(window, quarantine=True)
    allocator.decref(window.pages)  # the reservation expires
    assert allocator.num_free == 5, "a fenced page went back to the free list"
    assert fences.quarantined_pages() == 3
    assert not fences.lift_writer("r1", 8), "a wrong nonce must not lift the fence"
    assert fences.lift_writer("r1", 7)
    assert allocator.num_free == 8 and fences.quarantined_pages() == 0
    assert not fences.lift_writer("r1", 7), "a fence comes down once"


def test_live_reservations_are_not_counted_as_quarantined():
    _, fences, window = _setup(alive=True)
    fences.raise_fence(window, quarantine=True)
    assert fences.quarantined_pages() == 0


def test_each_writer_holds_its_own_fence():
    allocator, fences, window = _setup()
    fences.raise_fence(window, quarantine=True)
    fences.raise_fence(window, quarantine=True)  # a retried writer
    assert [allocator.refcount(p) for p in window.pages] == [3, 3, 3]
    fences.lift_writer("r1", 7)
    assert [allocator.refcount(p) for p in window.pages] == [2, 2, 2]


def test_a_silent_writer_is_released_after_the_quarantine():
    allocator, fences, window = _setup()
    fences.raise_fence(window, quarantine=True)
    allocator.decref(window.pages)
    assert fences.expire_due(time.monotonic()) == 0
    assert fences.expire_due(time.monotonic() + 31) == 1
    assert allocator.num_free == 8


def test_a_fence_the_receiver_lifts_never_expires():
    """TCP's cheap case: the receiver holds the fence for as long as its connection writes."""
    allocator, fences, window = _setup()
    fence = fences.raise_fence(window, quarantine=False)
    allocator.decref(window.pages)
    assert fences.expire_due(time.monotonic() + 3600) == 0 and allocator.num_free == 5
    fences.lift(fence)
    assert allocator.num_free == 8


def test_lift_all_drops_every_fence():
    allocator, fences, window = _setup()
    fences.raise_fence(window, quarantine=True)
    fences.raise_fence(WriteWindow("r2", 9, window.placement, window.pages[1:], lambda: False), quarantine=True)
    allocator.decref(window.pages)
    fences.lift_all()
    assert allocator.num_free == 8
