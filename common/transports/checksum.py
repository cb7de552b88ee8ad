"""Checksums of a transfer's KV: xxh3-64 of each (layer, K|V)'s bytes at a window's slots, in
position order. The sender computes them from its pool after the last layer was posted, the
receiver from its own slots before the request may generate (`--verify-kv`), so a byte that was
lost, misdirected or overwritten on the way (a late writer, an early free) is caught instead of
served. Checksum `2 * layer + kv` covers that layer's K (`kv` 0) or V (1); a layer that a transfer
moves only in part (a hybrid model's sliding layer, which gets its window) is hashed over the slots
it moved, in its own group where the pool gives its sliding layers one.

On a CPU pool the hash streams over the window's runs of consecutive slots where they lie
(a run of one (layer, K|V) is one contiguous byte range): gathering them into a fresh tensor
first cost many times the hashing itself (docs/bench/README.md, "Figures behind the code"), and
the receiver's check is on the way to the request's first token. XXH3 fed in pieces gives the
digest of their concatenation, so a CUDA pool, gathered on the device and hashed in one piece,
agrees with a CPU peer."""
from __future__ import annotations

import torch
import xxhash

from collections.abc import Sequence

import numpy as np

from common.kv.pool import KVPool
from common.kv.segments import Segments


def kv_checksums(pool: KVPool, layer_slots: Sequence[np.ndarray]) -> list[int]:
    """The `2 * num_layers` checksums of the K/V of each layer at its `layer_slots` (position
    order, the slots of its group: common/transports/layer_slots.py)."""
    checksums = []
    runs_of: dict[int, tuple[tuple[int, int], ...]] = {}  # by id of a slot array: layers share them
    for layer, slots in enumerate(layer_slots):
        kv = pool.layer_kv(layer)
        if kv.is_cuda:
            rows = kv.index_select(1, torch.as_tensor(slots, device=kv.device)).cpu()  # [2, n, heads, head_dim]
            flat = rows.view(torch.uint8).reshape(2, len(slots), -1).numpy()
            checksums += [xxhash.xxh3_64_intdigest(flat[i]) for i in (0, 1)]
            continue
        if id(slots) not in runs_of:
            runs_of[id(slots)] = Segments.of_slots(slots).runs
            if any(start < 0 or start + length > kv.shape[1] for start, length in runs_of[id(slots)]):
                raise IndexError(f"slots outside layer {layer}'s {kv.shape[1]}")
        for row in pool.layer_bytes(layer):
            h = xxhash.xxh3_64()
            for start, length in runs_of[id(slots)]:
                h.update(row[start:start + length])
            checksums.append(h.intdigest())
    return checksums


def first_mismatch(ours: list[int], theirs: list[int]) -> str | None:
    """Where two checksum lists first differ, for a person ("layer 3 V"); None if they agree."""
    if len(ours) != len(theirs):
        return f"{len(theirs)} checksums where {len(ours)} (2 per layer) are expected"
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    return None if i is None else f"layer {i // 2} {'KV'[i % 2]}"
