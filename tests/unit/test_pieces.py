"""From pieces to what the transports move: whole pages (prepared NIXL blocks) and edges."""
from __future__ import annotations

import numpy as np

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.segments import Segments
from common.kv.pool import KVPool
from common.transports.pieces import Piece, plan_pages, plan_pieces

PAGE = 4


@st.composite
def transfers(draw) -> tuple[list[int], list[tuple[int, int]]]:
    """A window [begin, end) of a sequence on random page tables of two pools (same page size),
    as the prefill node's source slots and the decode node's destination segments."""
    pages = draw(st.integers(1, 12))
    begin = draw(st.integers(0, pages * PAGE - 1))
    end = draw(st.integers(begin + 1, pages * PAGE))
    src_table = draw(st.permutations(range(16)))[:pages]
    dst_table = draw(st.permutations(range(16)))[:pages]
    slots = [[t[p // PAGE] * PAGE + p % PAGE for p in range(begin, end)] for t in (src_table, dst_table)]
    dst_segments: list[tuple[int, int]] = []
    for s in slots[1]:
        if dst_segments and sum(dst_segments[-1]) == s:
            dst_segments[-1] = (dst_segments[-1][0], dst_segments[-1][1] + 1)
        else:
            dst_segments.append((s, 1))
    return slots[0], dst_segments


@settings(max_examples=200, deadline=None)
@given(transfers())
def test_pages_and_edges_cover_every_slot_once_with_edges_only_off_page_boundaries(transfer):
    src_slots, dst_segments = transfer
    pieces = plan_pieces(src_slots, Segments(tuple(dst_segments)))
    plan = plan_pages(pieces, PAGE)
    moved = sorted(
        [(int(s) * PAGE + o, int(d) * PAGE + o) for s, d in zip(plan.src_pages, plan.dst_pages) for o in range(PAGE)]
        + [(e.src_slot + i, e.dst_slot + i) for e in plan.edges for i in range(e.num_slots)])
    dst_slots = [s for start, n in dst_segments for s in range(start, start + n)]
    assert moved == sorted(zip(src_slots, dst_slots))
    # At most a partial first and last page per piece go as ranges.
    assert len(plan.edges) <= 2 * len(pieces) and all(e.num_slots < PAGE for e in plan.edges)


def test_offsets_that_disagree_go_whole_as_ranges():
    plan = plan_pages([Piece(src_slot=1, dst_slot=6, num_slots=9)], PAGE)
    assert len(plan.src_pages) == 0 and plan.edges == [Piece(1, 6, 9)]


def test_page_blocks_number_pages_per_layer_and_kv():
    layout = KVPool(num_layers=2, num_kv_heads=1, head_dim=5, num_pages=3, page_size=PAGE).layout
    blocks = layout.page_blocks(base=1000)
    assert blocks.shape == (2 * 2 * 3, 2) and (blocks[:, 1] == PAGE * 20).all()
    # block (layer 1, V, page 2) = (1 * 2 + 1) * 3 + 2
    assert layout.block_index(1, 1, np.array([2]))[0] == 11
    assert blocks[11, 0] == 1000 + ((1 * 2 + 1) * 3 * PAGE + 2 * PAGE) * 20


def test_a_sliding_group_lies_after_the_full_group_in_the_layout():
    """A hybrid model's sliding layers on pages of their own: their planes follow the full layers'
    in the one registered region, each as many pages long as the sliding group has; a peer's
    layout comes from its slot counts."""
    pool = KVPool(num_layers=3, num_kv_heads=1, head_dim=5, num_pages=3, page_size=PAGE, sliding_layers=(1,),
                  sliding_pages=2)
    layout, sb = pool.layout, pool.slot_bytes()
    assert layout.size_bytes == pool.storage.numel() * 4 == (2 * 3 + 2) * 2 * PAGE * sb
    full_planes = 2 * 2 * 3 * PAGE
    assert layout.offset(2, 1, 5) == ((1 * 2 + 1) * 3 * PAGE + 5) * sb  # layer 2 is the full group's second
    assert layout.offset(1, 1, 5) == (full_planes + 2 * PAGE + 5) * sb
    for layer in range(3):
        for kv in (0, 1):
            plane = pool.layer_kv(layer)[kv]
            assert plane.data_ptr() - pool.storage.data_ptr() == layout.offset(layer, kv, 0)
    assert layout.block_index(1, 0, np.array([1]))[0] == 12 + 1
    peer = layout.with_slots(num_slots=5 * PAGE, sliding_slots=4 * PAGE)
    assert peer.offset(1, 0, 0) == 2 * 2 * 5 * PAGE * sb and peer.size_bytes == (2 * 5 + 4) * 2 * PAGE * sb
