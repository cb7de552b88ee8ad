"""The paged KV pool: one tensor `[num_layers, 2 (K,V), num_slots, num_kv_heads, head_dim]`.

A slot is `page_id * page_size + offset_in_page`. A run of consecutive slots of one
(layer, K|V) is one contiguous byte range, which is what the transports rely on.
"""
from __future__ import annotations

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
    ) -> None:
        if page_size <= 0 or num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.data = torch.zeros(
            (num_layers, 2, self.num_slots, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def keys(self, layer: int) -> torch.Tensor:
        """`[num_slots, num_kv_heads, head_dim]` view of one layer's K."""
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def slot_bytes(self) -> int:
        """Bytes of one slot of one (layer, K|V)."""
        return self.num_kv_heads * self.head_dim * self.data.element_size()
