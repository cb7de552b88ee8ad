"""From slot runs to the byte ranges a transport moves.

A transfer copies, for every layer and for K and V, positions `[begin, end)` of a sequence from
the sender's slots to the receiver's reserved slots. Both sides describe their slots as runs of
consecutive slots; a *piece* is a maximal run that is consecutive on both sides, so it is one
contiguous byte range on each side for every (layer, K|V).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.kv.pool import KVPool
from common.kv.segments import Segments


@dataclass(frozen=True)
class Piece:
    src_slot: int
    dst_slot: int
    num_slots: int


def plan_pieces(src_slots: Sequence[int] | np.ndarray, dst: Segments) -> list[Piece]:
    """Split the copy of `src_slots` (position order) into the `dst` runs into pieces."""
    src_runs, dst_runs = Segments.of_slots(src_slots).runs, dst.runs
    pieces: list[Piece] = []
    si = di = 0
    s_start, s_left = src_runs[0] if src_runs else (0, 0)
    d_start, d_left = dst_runs[0] if dst_runs else (0, 0)
    while si < len(src_runs) and di < len(dst_runs):
        n = min(s_left, d_left)
        pieces.append(Piece(s_start, d_start, n))
        s_start, s_left, d_start, d_left = s_start + n, s_left - n, d_start + n, d_left - n
        if s_left == 0 and (si := si + 1) < len(src_runs):
            s_start, s_left = src_runs[si]
        if d_left == 0 and (di := di + 1) < len(dst_runs):
            d_start, d_left = dst_runs[di]
    return pieces


def transfer_bytes(pool: KVPool, num_slots: int, skips: Sequence[int]) -> int:
    """Bytes a transfer of `num_slots` positions moves: K and V of every layer, less each layer's
    skipped leading positions."""
    return sum(num_slots - skip for skip in skips) * 2 * pool.slot_bytes()


def layer_byte_ranges(pool: KVPool, layer: int, slots_and_counts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Absolute (address, nbytes) of the given slot runs of one layer, K runs then V runs."""
    base, sb, layout = pool.storage.data_ptr(), pool.slot_bytes(), pool.layout
    return [(base + layout.offset(layer, kv, start), n * sb) for kv in (0, 1) for start, n in slots_and_counts]


@dataclass(frozen=True)
class PagePlan:
    """A transfer's pieces split into whole pages, which move as prepared blocks, and the
    partial-page `edges` left over (a piece's ends off page boundaries), which move as ranges."""

    src_pages: np.ndarray  # int64, paired with dst_pages
    dst_pages: np.ndarray
    edges: list[Piece]


def plan_pages(pieces: Sequence[Piece], page_size: int) -> PagePlan:
    """Whole pages where a piece's source and destination agree on the offset inside a page
    (always, between pools of one page size: both hold position p at offset p % page_size)."""
    src, dst, edges = [], [], []
    for p in pieces:
        head = (-p.src_slot) % page_size if p.src_slot % page_size == p.dst_slot % page_size else p.num_slots
        head = min(head, p.num_slots)
        full = (p.num_slots - head) // page_size
        if head:
            edges.append(Piece(p.src_slot, p.dst_slot, head))
        if full:
            src.append(np.arange(full, dtype=np.int64) + (p.src_slot + head) // page_size)
            dst.append(np.arange(full, dtype=np.int64) + (p.dst_slot + head) // page_size)
        if tail := p.num_slots - head - full * page_size:
            done = head + full * page_size
            edges.append(Piece(p.src_slot + done, p.dst_slot + done, tail))
    empty = np.zeros(0, dtype=np.int64)
    return PagePlan(np.concatenate(src) if src else empty, np.concatenate(dst) if dst else empty, edges)
