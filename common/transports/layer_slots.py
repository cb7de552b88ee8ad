"""Per layer, the slots a transfer's window `[begin, end)` occupies on one side of it.

Layer i moves the window's positions from offset `skips[i]` on (a hybrid model's sliding layers
move their window only: common/engine/attention_window.layer_skips). Where a pool keeps those
layers in a sliding group of their own (common/kv/pool.py), their positions lie on that group's
slots: on the sender through its sliding pages' map, at the receiver where its `Placement` says.
Either side may have the group without the other: each layer's bytes go from its slots on one
side to its slots on the other. Layers that agree on (skip, group) share one array.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from common.kv.segments import Placement, Segments
from common.transports.pieces import Piece, plan_pieces


def _per_layer(skips: Sequence[int], in_group: Callable[[int], bool],
               slots_from: Callable[[int, bool], np.ndarray]) -> list[np.ndarray]:
    memo: dict[tuple[int, bool], np.ndarray] = {}
    out = []
    for layer, skip in enumerate(skips):
        key = (skip, in_group(layer))
        if key not in memo:
            memo[key] = slots_from(*key)
        out.append(memo[key])
    return out


def sender_layer_slots(window: torch.Tensor | np.ndarray, skips: Sequence[int],
                       sliding_layers: Collection[int],
                       sliding_slots: Callable[[torch.Tensor], torch.Tensor] | None) -> list[np.ndarray]:
    """Per layer, the sender's slots of the positions it moves: `window`, the full slots of the
    whole window, from the layer's skip on, mapped by `sliding_slots` for the layers of the
    sender's sliding group (None: it has none)."""
    window = torch.as_tensor(window, dtype=torch.long)

    def slots_from(skip: int, sliding: bool) -> np.ndarray:
        part = window[skip:]
        return (sliding_slots(part) if sliding else part).numpy()

    return _per_layer(skips, lambda layer: sliding_slots is not None and layer in sliding_layers, slots_from)


def receiver_layer_slots(placement: Placement, skips: Sequence[int], sliding_layers: Collection[int]) -> list[np.ndarray]:
    """Per layer, the receiver's slots of the positions that layer is sent, as `placement` names
    them: its sliding group's for a sliding layer where it has one, which holds the window's last
    `placement.sliding.num_slots` positions."""
    full = placement.full.slots()
    sliding = None if placement.sliding is None else placement.sliding.slots()

    def slots_from(skip: int, in_sliding: bool) -> np.ndarray:
        if not in_sliding:
            return full[skip:]
        first = skip - (len(full) - len(sliding))
        if first < 0:
            raise ValueError(f"a sliding layer moves {len(full) - skip} positions but the sliding group holds "
                             f"{len(sliding)}")
        return sliding[first:]

    return _per_layer(skips, lambda layer: sliding is not None and layer in sliding_layers, slots_from)


def layer_pieces(src: torch.Tensor, offset: int, skips: Sequence[int], sliding_layers: Collection[int],
                 sliding_slots: Callable[[torch.Tensor], torch.Tensor] | None,
                 dst: Sequence[np.ndarray]) -> list[list[Piece]]:
    """Per layer, the pieces moving the window's positions `[offset, offset + len(src))` that
    the layer moves: `src` holds the sender's full slots of those positions (this side's slots per
    layer: `sender_layer_slots` of the chunk), `dst` the receiver's slots per layer
    (`receiver_layer_slots` of the whole window)."""
    stop = offset + len(src)
    ours = sender_layer_slots(src, [min(len(src), max(0, skip - offset)) for skip in skips], sliding_layers,
                              sliding_slots)
    memo: dict[tuple[int, int], list[Piece]] = {}  # layers sharing both arrays share their pieces
    out = []
    for layer, skip in enumerate(skips):
        key = (id(ours[layer]), id(dst[layer]))
        if key not in memo:
            first = max(offset, skip)
            memo[key] = [] if first >= stop else plan_pieces(ours[layer],
                                                             Segments.of_slots(dst[layer][first - skip : stop - skip]))
        out.append(memo[key])
    return out
