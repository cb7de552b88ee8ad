"""Page tables to slots and the kv_append_metadata codec: round trips over random page layouts,
invariants, validation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.segments import RELEASED, MetadataError, Segments, slot_range, slots_at


@st.composite
def page_layouts(draw: st.DrawFn) -> tuple[int, int, list[int], int, int]:
    """(page_size, num_pages, page table, start, end): a random permutation of some pool pages
    and a random window of positions on it."""
    page_size = draw(st.integers(1, 8))
    num_pages = draw(st.integers(1, 24))
    table = draw(st.permutations(range(num_pages)))[: draw(st.integers(1, num_pages))]
    start = draw(st.integers(0, len(table) * page_size))
    end = draw(st.integers(start, len(table) * page_size))
    return page_size, num_pages, table, start, end


def check_invariants(segments: Segments, slots: list[int]) -> None:
    wire = segments.to_wire()
    assert len(wire) == 2 * wire[0] + 1 and len(segments) == wire[0]
    assert segments.num_slots == len(slots)
    assert segments.slots().tolist() == slots
    for (a_start, a_len), (b_start, _) in zip(segments, list(segments)[1:]):
        assert a_start + a_len != b_start, "adjacent segments are contiguous: not maximal"


@settings(max_examples=300, deadline=None)
@given(page_layouts())
def test_round_trip_over_page_layouts(layout: tuple[int, int, list[int], int, int]) -> None:
    page_size, num_pages, table, start, end = layout
    slots = slot_range(table, page_size, start, end).tolist()
    assert slots == [table[p // page_size] * page_size + p % page_size for p in range(start, end)]
    segments = Segments.of_slots(slots)
    check_invariants(segments, slots)
    assert Segments.from_wire(segments.to_wire(), end - start, num_pages * page_size) == segments


@settings(max_examples=200, deadline=None)
@given(page_layouts(), st.data())
def test_a_window_of_segments_is_the_segments_of_those_slots(layout, data) -> None:
    page_size, _, table, start, end = layout
    slots = slot_range(table, page_size, start, end).tolist()
    lo = data.draw(st.integers(0, len(slots)))
    hi = data.draw(st.integers(lo, len(slots)))
    assert Segments.of_slots(slots).window(lo, hi) == Segments.of_slots(slots[lo:hi])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True))
def test_round_trip_of_arbitrary_distinct_slots(slots: list[int]) -> None:
    check_invariants(Segments.of_slots(slots), slots)


def test_design_example() -> None:
    slots = slot_range([7, 2], page_size=4, start=1, end=7).tolist()
    assert slots == [29, 30, 31, 8, 9, 10]
    assert Segments.of_slots(slots).to_wire() == [2, 29, 3, 8, 3]
    assert Segments.from_wire([2, 29, 3, 8, 3], expected_tokens=6, num_slots=32).runs == ((29, 3), (8, 3))


def test_empty_reservation() -> None:
    assert Segments.of_slots([]).to_wire() == [0]
    assert Segments.from_wire([0], expected_tokens=0, num_slots=16) == Segments(())
    assert Segments(()).slots().tolist() == []
    assert slot_range([3], page_size=4, start=2, end=2).tolist() == []


def test_accepts_numpy_and_non_maximal_but_valid_segments() -> None:
    got = Segments.from_wire(np.array([2, 4, 2, 6, 1], dtype=np.int64), 3, 8)
    assert got.runs == ((4, 2), (6, 1)) and got.slots().tolist() == [4, 5, 6]


@pytest.mark.parametrize(
    ("metadata", "expected_tokens", "message"),
    [
        ([], 0, "is empty"),
        ([-1], 0, "n=-1 segments; n must be >= 0"),
        ([2, 0, 4], 4, r"has 3 entries but n=2 segments need 2n\+1 = 5"),
        ([1, 0, 4, 9], 4, r"has 4 entries but n=1 segments need 2n\+1 = 3"),
        ([0, 1, 2], 0, "has 3 entries but n=0"),
        ([2, 0, 2, 8, 0], 2, r"segment 1 \(start=8, len=0\): len must be positive"),
        ([1, 4, -2], -2, r"segment 0 \(start=4, len=-2\): len must be positive"),
        ([1, -1, 2], 2, r"segment 0 \(start=-1, len=2\): start must be >= 0"),
        ([2, 0, 2, 30, 3], 5, r"segment 1 covers slots \[30, 33\) but the pool has 32 slots"),
        ([1, 32, 1], 1, r"covers slots \[32, 33\)"),
        ([2, 29, 3, 8, 3], 5, "segments cover 6 tokens but 5 are expected"),
        ([0], 1, "segments cover 0 tokens but 1 are expected"),
        ([2, 8, 4, 10, 1], 5, r"segment 1 slots \[10, 11\) overlap segment 0 slots \[8, 12\)"),
        ([3, 20, 2, 4, 4, 6, 1], 7, r"segment 2 slots \[6, 7\) overlap segment 1 slots \[4, 8\)"),
        ([2, 5, 1, 5, 1], 2, r"segment 1 slots \[5, 6\) overlap segment 0"),
    ],
)
def test_from_wire_rejects(metadata: list[int], expected_tokens: int, message: str) -> None:
    with pytest.raises(MetadataError, match=message):
        Segments.from_wire(metadata, expected_tokens, num_slots=32)


def test_metadata_error_is_a_value_error() -> None:
    assert issubclass(MetadataError, ValueError)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 9)])
def test_slot_range_rejects_positions_outside_the_table(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="outside the 2-page table"):
        slot_range([5, 1], page_size=4, start=start, end=end)


def test_slots_at_refuses_a_released_entry() -> None:
    assert slots_at([RELEASED, 3], 4, torch.tensor([4, 6])).tolist() == [12, 14]
    with pytest.raises(RuntimeError, match="released KV page"):
        slots_at([RELEASED, 3], 4, torch.tensor([1, 4]))
