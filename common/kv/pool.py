"""The paged KV pool: per layer and K|V a *plane* of slots `[num_slots, num_kv_heads, head_dim]`.

A slot is `page_id * page_size + offset_in_page`. A run of consecutive slots of one plane is one
contiguous byte range, which is what the transports rely on.

Every model's layers hold `num_pages` pages, except a hybrid model's sliding layers (Gemma 2/3,
gpt-oss), which form a second group on `sliding_pages` pages of their own (common/kv/sliding_pages.py):
they need only their window's K/V (`sliding_pages` 0: no group, they share the pages). Both groups live in one allocation, `storage` (what a NIXL
agent registers): the full group's planes `data` `[full layers, 2, num_slots, heads, head_dim]`,
then the sliding group's `sliding_data` `[sliding layers, 2, sliding_slots, heads, head_dim]`.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np
import torch

LAYOUT_VERSION = 1


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        sliding_layers: Collection[int] = (),
        sliding_pages: int = 0,
    ) -> None:
        if page_size <= 0 or num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")
        if sliding_pages < 0:
            raise ValueError("sliding_pages must be >= 0")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.window_layers = tuple(sorted(sliding_layers))  # the model's sliding layers, grouped or not
        self.sliding_layers = self.window_layers if sliding_pages else ()  # those of the sliding group
        self.sliding_pages = sliding_pages if self.sliding_layers else 0
        self.sliding_slots = self.sliding_pages * page_size
        full_layers = [layer for layer in range(num_layers) if layer not in self.sliding_layers]
        self._sliding = frozenset(self.sliding_layers)
        shapes = [(len(full_layers), 2, self.num_slots, num_kv_heads, head_dim),
                  (len(self.sliding_layers), 2, self.sliding_slots, num_kv_heads, head_dim)]
        sizes = [torch.Size(s).numel() for s in shapes]
        self.storage = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self.data = self.storage[: sizes[0]].view(shapes[0])
        self.sliding_data = self.storage[sizes[0]:].view(shapes[1])
        # Each layer's view, made once: the forward asks for them every layer of every step.
        index = {layer: i for group in (full_layers, self.sliding_layers) for i, layer in enumerate(group)}
        self._layer_kv = [(self.sliding_data if layer in self._sliding else self.data)[index[layer]]
                          for layer in range(num_layers)]
        self._layer_bytes: list[np.ndarray] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` is in the sliding group (its slots are sliding slots)."""
        return layer in self._sliding

    def layer_kv(self, layer: int) -> torch.Tensor:
        """`[2 (K,V), slots of its group, num_kv_heads, head_dim]` view of one layer."""
        return self._layer_kv[layer]

    def layer_bytes(self, layer: int) -> np.ndarray:
        """A CPU pool's layer as bytes, `[2 (K,V), slots of its group, slot_bytes]` (numpy views,
        made once: checksums read every layer of every transfer)."""
        if self._layer_bytes is None:
            self._layer_bytes = [kv.view(torch.uint8).reshape(2, kv.shape[1], -1).numpy() for kv in self._layer_kv]
        return self._layer_bytes[layer]

    def keys(self, layer: int) -> torch.Tensor:
        """`[slots, num_kv_heads, head_dim]` view of one layer's K."""
        return self._layer_kv[layer][0]

    def values(self, layer: int) -> torch.Tensor:
        return self._layer_kv[layer][1]

    def slots_of(self, layer: int) -> int:
        """Slots of the layer's group."""
        return self.sliding_slots if self.is_sliding(layer) else self.num_slots

    def slot_bytes(self) -> int:
        """Bytes of one slot of one (layer, K|V)."""
        return self.num_kv_heads * self.head_dim * self.storage.element_size()

    @property
    def layout(self) -> PoolLayout:
        return PoolLayout(self.num_layers, self.sliding_layers, self.num_slots, self.sliding_slots,
                          self.page_size, self.slot_bytes(), self.window_layers)


@dataclass(frozen=True)
class PoolLayout:
    """Where each (layer, K|V) plane lies in a pool's `storage`, in bytes: a pool's own, or a
    peer's of the same model (whose slot counts its TransportInfo gives)."""

    num_layers: int
    sliding_layers: tuple[int, ...]
    num_slots: int
    sliding_slots: int
    page_size: int
    slot_bytes: int
    window_layers: tuple[int, ...] = ()  # the model's sliding layers, which a sliding group holds

    def with_slots(self, num_slots: int, sliding_slots: int) -> PoolLayout:
        """The layout of a peer's pool of the same model with these slot counts (a sliding group
        of its own where `sliding_slots`)."""
        return replace(self, num_slots=num_slots, sliding_slots=sliding_slots,
                       sliding_layers=self.window_layers if sliding_slots else ())

    @property
    def _full_layers(self) -> int:
        return self.num_layers - len(self.sliding_layers)

    def _plane(self, layer: int, kv: int) -> tuple[int, int]:
        """(first slot of the plane counted over all planes, slots of the plane)."""
        if layer in self.sliding_layers:
            i = self.sliding_layers.index(layer)
            return self._full_layers * 2 * self.num_slots + (2 * i + kv) * self.sliding_slots, self.sliding_slots
        i = layer - sum(1 for s in self.sliding_layers if s < layer)
        return (2 * i + kv) * self.num_slots, self.num_slots

    def offset(self, layer: int, kv: int, slot: int) -> int:
        """Byte offset of a slot of one (layer, K|V) from the start of the storage."""
        return (self._plane(layer, kv)[0] + slot) * self.slot_bytes

    @property
    def size_bytes(self) -> int:
        return (self._full_layers * self.num_slots + len(self.sliding_layers) * self.sliding_slots) * 2 * self.slot_bytes

    def page_blocks(self, base: int) -> np.ndarray:
        """`(num blocks, 2)` array of (address, nbytes): every page of every plane of a storage at
        `base`, in storage order; `block_index` numbers them."""
        page_bytes = self.page_size * self.slot_bytes
        count = self.size_bytes // page_bytes
        blocks = np.empty((count, 2), dtype=np.int64)
        blocks[:, 0] = base + np.arange(count, dtype=np.int64) * page_bytes
        blocks[:, 1] = page_bytes
        return blocks

    def block_index(self, layer: int, kv: int, pages: np.ndarray) -> np.ndarray:
        """The `page_blocks` indices of pages of one (layer, K|V) (sliding pages in a sliding layer)."""
        return pages + self._plane(layer, kv)[0] // self.page_size
