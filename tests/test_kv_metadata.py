"""The kv_append_metadata codec: round trips over random page layouts, invariants, validation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.kv_metadata import (
    MetadataError,
    decode_segments,
    encode_segments,
    expand_slots,
    reservation_slots,
    validate_metadata,
)
from common.kv.kv_pool import KVPool


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


def check_invariants(metadata: list[int], slots: list[int]) -> None:
    n = metadata[0]
    segments = decode_segments(metadata)
    assert len(metadata) == 2 * n + 1
    assert sum(length for _, length in segments) == len(slots)
    assert expand_slots(metadata) == slots
    for (a_start, a_len), (b_start, _) in zip(segments, segments[1:]):
        assert a_start + a_len != b_start, "adjacent segments are contiguous: not maximal"


@settings(max_examples=300, deadline=None)
@given(page_layouts())
def test_round_trip_over_page_layouts(layout: tuple[int, int, list[int], int, int]) -> None:
    page_size, num_pages, table, start, end = layout
    slots = reservation_slots(table, page_size, start, end)
    metadata = encode_segments(slots)
    check_invariants(metadata, slots)
    segments = validate_metadata(metadata, end - start, num_pages * page_size)
    assert segments == decode_segments(metadata)


@settings(max_examples=50, deadline=None)
@given(page_layouts())
def test_reservation_slots_agree_with_kv_pool(layout: tuple[int, int, list[int], int, int]) -> None:
    page_size, num_pages, table, start, end = layout
    pool = KVPool(1, 1, 1, num_pages=num_pages, page_size=page_size)
    expected = pool.slots_for(table, start, end).tolist()
    assert reservation_slots(table, page_size, start, end) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True))
def test_round_trip_of_arbitrary_distinct_slots(slots: list[int]) -> None:
    check_invariants(encode_segments(slots), slots)


def test_design_example() -> None:
    slots = reservation_slots([7, 2], page_size=4, start=1, end=7)
    assert slots == [29, 30, 31, 8, 9, 10]
    assert encode_segments(slots) == [2, 29, 3, 8, 3]
    assert validate_metadata([2, 29, 3, 8, 3], expected_tokens=6, num_slots=32) == [(29, 3), (8, 3)]


def test_empty_reservation() -> None:
    assert encode_segments([]) == [0]
    assert decode_segments([0]) == [] and expand_slots([0]) == []
    assert validate_metadata([0], expected_tokens=0, num_slots=16) == []
    assert reservation_slots([3], page_size=4, start=2, end=2) == []


def test_accepts_numpy_and_non_maximal_but_valid_segments() -> None:
    np = pytest.importorskip("numpy")
    assert validate_metadata(np.array([2, 4, 2, 6, 1], dtype=np.int64), 3, 8) == [(4, 2), (6, 1)]


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
def test_validate_rejects(metadata: list[int], expected_tokens: int, message: str) -> None:
    with pytest.raises(MetadataError, match=message):
        validate_metadata(metadata, expected_tokens, num_slots=32)


def test_metadata_error_is_a_value_error() -> None:
    assert issubclass(MetadataError, ValueError)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 9)])
def test_reservation_slots_rejects_positions_outside_the_table(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="outside the 2-page table"):
        reservation_slots([5, 1], page_size=4, start=start, end=end)
