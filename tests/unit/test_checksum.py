"""KV checksums (common/transports/checksum.py): the same bytes at other slots of another pool
agree, one changed element or a swapped pair of positions does not."""
from __future__ import annotations

import pytest
import torch
import xxhash

from common.kv.pool import KVPool
from common.transports.checksum import first_mismatch
from common.transports.checksum import kv_checksums as layer_checksums


def kv_checksums(pool: KVPool, slots: torch.Tensor, skips: tuple[int, ...] | None = None) -> list[int]:
    """Each layer's checksums over `slots[skip:]` (one slot array per layer, as a transfer gives)."""
    return layer_checksums(pool, [slots[skip:].numpy() for skip in skips or (0,) * pool.num_layers])


def _pools(dtype: torch.dtype) -> tuple[KVPool, KVPool]:
    src = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4, dtype=dtype)
    src.data.copy_(torch.randn_like(src.data, dtype=torch.float32).to(dtype))
    return src, KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4, dtype=dtype)


def test_the_same_kv_at_other_slots_has_the_same_checksums():
    for dtype in (torch.float32, torch.bfloat16):
        src, dst = _pools(dtype)
        src_slots, dst_slots = torch.tensor([5, 6, 7, 20, 21]), torch.tensor([0, 1, 2, 3, 30])
        dst.data[:, :, dst_slots] = src.data[:, :, src_slots]
        ours = kv_checksums(src, src_slots)
        assert len(ours) == 6 and ours == kv_checksums(dst, dst_slots)
        assert first_mismatch(ours, kv_checksums(dst, dst_slots)) is None


def test_one_changed_element_or_swapped_positions_are_caught_and_located():
    src, dst = _pools(torch.float32)
    slots = torch.tensor([4, 5, 6, 7])
    dst.data.copy_(src.data)
    dst.data[2, 1, 6, 1, 3] += 1e-6  # layer 2, V
    assert first_mismatch(kv_checksums(src, slots), kv_checksums(dst, slots)) == "layer 2 V"
    assert first_mismatch(kv_checksums(src, slots), kv_checksums(src, slots.flip(0))) == "layer 0 K"
    assert "2 per layer" in first_mismatch(kv_checksums(src, slots), [1, 2])


def test_hashing_the_runs_where_they_lie_gives_the_digest_of_the_gathered_bytes():
    """The CPU path streams over runs of slots; each digest must be xxh3 of the window's bytes
    gathered in position order (what a CUDA pool hashes), runs of one slot and reversed ones included."""
    for dtype in (torch.float32, torch.bfloat16):
        src, _ = _pools(dtype)
        slots = torch.tensor([9, 10, 11, 12, 2, 30, 31, 0, 1, 17])
        gathered = src.data[:, :, slots].contiguous().view(torch.uint8).reshape(6, -1).numpy()
        assert kv_checksums(src, slots) == [xxhash.xxh3_64_intdigest(row) for row in gathered]


def test_slots_outside_the_pool_are_refused():
    src, _ = _pools(torch.float32)
    with pytest.raises(IndexError):
        kv_checksums(src, torch.tensor([30, 31, 32]))


def test_a_layer_that_skips_positions_is_hashed_over_the_rest_only():
    """A hybrid model's sliding layer moves only its window: its checksums cover `slots[skip:]`,
    so KV it never sent (garbage on the receiver) cannot fail the check, and what it sent still can."""
    src, dst = _pools(torch.float32)
    slots, skips = torch.tensor([3, 4, 5, 6, 9, 10]), (0, 4, 0)
    dst.data.copy_(src.data)
    dst.data[1, :, slots[:4]] = 7.0  # layer 1's skipped positions differ
    assert kv_checksums(src, slots, skips) == kv_checksums(dst, slots, skips)
    assert first_mismatch(kv_checksums(src, slots), kv_checksums(dst, slots)) == "layer 1 K"
    gathered = src.data[1, :, slots[4:]].contiguous().view(torch.uint8).reshape(2, -1).numpy()
    assert kv_checksums(src, slots, skips)[2:4] == [xxhash.xxh3_64_intdigest(row) for row in gathered]
    dst.data[1, 1, 10] += 1.0  # a sent position of layer 1 V
    assert first_mismatch(kv_checksums(src, slots, skips), kv_checksums(dst, slots, skips)) == "layer 1 V"


def test_a_sliding_group_hashes_its_own_slots_as_a_pool_without_one_hashes_the_same_bytes():
    """A pool whose sliding layers have a group of their own (a hybrid model's, common/kv/pool.py)
    gives the checksums of a pool without one holding the same K/V: the digest is of the bytes,
    wherever each layer keeps them."""
    plain = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4)
    grouped = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4, sliding_layers=(0, 2),
                     sliding_pages=2)
    plain.data.copy_(torch.randn_like(plain.data))
    slots, sliding_slots = torch.tensor([9, 10, 11, 12]), torch.tensor([5, 6, 7, 0])
    for layer in range(3):
        at = sliding_slots if grouped.is_sliding(layer) else slots
        grouped.layer_kv(layer)[:, at] = plain.layer_kv(layer)[:, slots]
    per_layer = [(sliding_slots if grouped.is_sliding(layer) else slots).numpy() for layer in range(3)]
    assert layer_checksums(grouped, per_layer) == kv_checksums(plain, slots)
    grouped.sliding_data[1, 0, 6, 0, 0] += 1.0  # layer 2 K, in the sliding group
    assert first_mismatch(kv_checksums(plain, slots), layer_checksums(grouped, per_layer)) == "layer 2 K"
