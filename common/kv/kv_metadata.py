"""The compressed page-segment metadata of PrepareReceive (`kv_append_metadata`).

Flat int64 list `[n, start_0, len_0, start_1, len_1, ...]`: `start` is a flat slot index
(`page_id * page_size + offset_in_page`), each segment a maximal run of consecutive slots,
segments in position order. Page size 4, 6 tokens reserved on pages 7 and 2 starting at offset
1 of page 7 gives `[2, 29, 3, 8, 3]` (slots 29, 30, 31 then 8, 9, 10).

The receiver of metadata from the wire runs `validate_metadata` before any compute, so a bad
request fails with a precise message instead of writing outside its reservation.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class MetadataError(ValueError):
    """`kv_append_metadata` is malformed or does not fit the request or the pool."""


def encode_segments(slots: Sequence[int] | np.ndarray) -> list[int]:
    """Compress slots (in position order) into metadata with maximal runs; `[]` -> `[0]`."""
    a = np.asarray(slots, dtype=np.int64).reshape(-1)
    if a.size == 0:
        return [0]
    firsts = np.concatenate([[0], np.flatnonzero(np.diff(a) != 1) + 1])
    lengths = np.diff(np.concatenate([firsts, [a.size]]))
    return [len(firsts)] + np.column_stack([a[firsts], lengths]).ravel().tolist()


def decode_segments(metadata: Sequence[int]) -> list[tuple[int, int]]:
    """`(start, len)` pairs of well-formed metadata; check untrusted input with
    `validate_metadata` first."""
    n = int(metadata[0])
    return [(int(metadata[1 + 2 * i]), int(metadata[2 + 2 * i])) for i in range(n)]


def expand_slots(metadata: Sequence[int]) -> list[int]:
    """Every slot the metadata covers, in position order."""
    return [s for start, length in decode_segments(metadata) for s in range(start, start + length)]


def validate_metadata(
    metadata: Sequence[int], expected_tokens: int, num_slots: int
) -> list[tuple[int, int]]:
    """Check untrusted metadata against the request and the destination pool; return its segments.

    Raises `MetadataError` naming the first problem found: shape, a bad segment, slots outside
    `[0, num_slots)`, a token count other than `expected_tokens`, or segments that overlap.
    """
    if len(metadata) == 0:
        raise MetadataError("kv_append_metadata is empty; expected [n, start_0, len_0, ...]")
    n = int(metadata[0])
    if n < 0:
        raise MetadataError(f"kv_append_metadata declares n={n} segments; n must be >= 0")
    if len(metadata) != 2 * n + 1:
        raise MetadataError(
            f"kv_append_metadata has {len(metadata)} entries "
            f"but n={n} segments need 2n+1 = {2 * n + 1}"
        )
    segments = decode_segments(metadata)
    for i, (start, length) in enumerate(segments):
        if length <= 0:
            raise MetadataError(f"segment {i} (start={start}, len={length}): len must be positive")
        if start < 0:
            raise MetadataError(f"segment {i} (start={start}, len={length}): start must be >= 0")
        if start + length > num_slots:
            raise MetadataError(
                f"segment {i} covers slots [{start}, {start + length}) "
                f"but the pool has {num_slots} slots"
            )
    total = sum(length for _, length in segments)
    if total != expected_tokens:
        raise MetadataError(f"segments cover {total} tokens but {expected_tokens} are expected")
    by_start = sorted(range(n), key=lambda i: segments[i][0])
    for prev, cur in zip(by_start, by_start[1:]):
        (p_start, p_len), (c_start, c_len) = segments[prev], segments[cur]
        if p_start + p_len > c_start:
            raise MetadataError(
                f"segment {cur} slots [{c_start}, {c_start + c_len}) overlap "
                f"segment {prev} slots [{p_start}, {p_start + p_len})"
            )
    return segments


def reservation_slots(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    """Slots of positions `[start, end)` of a sequence whose page table is `pages`."""
    if not 0 <= start <= end <= len(pages) * page_size:
        raise ValueError(
            f"positions [{start}, {end}) are outside the {len(pages)}-page table "
            f"({len(pages) * page_size} positions)"
        )
    return [pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]
