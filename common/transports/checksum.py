"""Checksums of a transfer's KV: xxh3-64 of each (layer, K|V)'s bytes at a window's slots, in
position order. The sender computes them from its pool after the last layer was posted, the
receiver from its own slots before the request may generate (`--verify-kv`), so a byte that was
lost, misdirected or overwritten on the way (a late writer, an early free) is caught instead of
served. Checksum `2 * layer + kv` covers that layer's K (`kv` 0) or V (1)."""
from __future__ import annotations

import torch
import xxhash

from common.kv.pool import KVPool


def kv_checksums(pool: KVPool, slots: torch.Tensor) -> list[int]:
    """The `2 * num_layers` checksums of the K/V at `slots` (position order)."""
    rows = pool.data.index_select(2, slots.to(pool.data.device)).cpu()  # [layers, 2, n, heads, head_dim]
    flat = rows.view(torch.uint8).reshape(2 * pool.num_layers, -1).numpy()
    return [xxhash.xxh3_64_intdigest(row) for row in flat]


def first_mismatch(ours: list[int], theirs: list[int]) -> str | None:
    """Where two checksum lists first differ, for a person ("layer 3 V"); None if they agree."""
    if len(ours) != len(theirs):
        return f"{len(theirs)} checksums where {len(ours)} (2 per layer) are expected"
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    return None if i is None else f"layer {i // 2} {'KV'[i % 2]}"
