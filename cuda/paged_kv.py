"""Copy one layer's K/V between paged pool slots and a contiguous buffer.

`pool_layer_kv` is one layer of the KV pool, `pool.data[layer]`: `[2 (K,V), num_slots, heads,
head_dim]`. A *buffer* is `[2, n, heads, head_dim]`, contiguous: row i holds the K and V of slot
`slots[i]`, so a run of positions maps to its (possibly scattered, page-crossing) slots.

- :func:`scatter_to_slots` writes a buffer into the slots: the receive side of a transport that
  cannot write scattered destinations itself (it lands one contiguous buffer, this spreads it).
- :func:`gather_from_slots` reads the slots into a (new or given) buffer: a contiguous send
  buffer for such a transport.

The TCP transport gathers a GPU pool's layer with :func:`gather_from_slots` before copying it to
host memory (common/transports/tcp/). No transport here needs the scatter: each TCP
frame covers one contiguous run of destination slots, and NIXL writes the runs directly (one
descriptor per run); it is there for a transport that lands one buffer per layer.

Each picks its implementation per call: the CUDA kernels of cuda/paged_kv.cu when the pool is on
a CUDA device and the kernels built (cuda/extension.py), else the torch fallback
(`index_copy_` / `index_select`), which also serves CPU pools. Both give the same bytes. Inputs
are checked the same way on both paths (ValueError); checking slot bounds reads them, so CUDA
`slots` cost one device sync: pass them on the CPU where they are made (they are then copied to
the device without waiting for it). Slots must be distinct
(a sequence's are); with repeats, which row lands is unspecified.
"""
from __future__ import annotations

import torch

from cuda import extension

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scatter_to_slots(pool_layer_kv: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """`pool_layer_kv[:, slots[i]] = src[:, i]` for every i."""
    slots = _checked(pool_layer_kv, src, slots, "src")
    ops = _kernels_for(pool_layer_kv)
    (torch_scatter_to_slots if ops is None else ops.scatter_to_slots)(pool_layer_kv, src, slots)


def gather_from_slots(pool_layer_kv: torch.Tensor, slots: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """`out[:, i] = pool_layer_kv[:, slots[i]]`; `out` (allocated when None) is returned."""
    if out is None:
        out = pool_layer_kv.new_empty((2, slots.numel(), *pool_layer_kv.shape[2:]))
    slots = _checked(pool_layer_kv, out, slots, "out")
    ops = _kernels_for(pool_layer_kv)
    (torch_gather_from_slots if ops is None else ops.gather_from_slots)(pool_layer_kv, slots, out)
    return out


def _kernels_for(pool_layer_kv: torch.Tensor) -> object | None:
    """The CUDA kernels for a pool on a GPU, when they built; None: use the torch fallback."""
    return extension.kernels() if pool_layer_kv.is_cuda else None


def torch_scatter_to_slots(pool_layer_kv: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """The fallback of :func:`scatter_to_slots` (inputs already checked)."""
    pool_layer_kv.index_copy_(1, slots, src)


def torch_gather_from_slots(pool_layer_kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """The fallback of :func:`gather_from_slots` (inputs already checked)."""
    torch.index_select(pool_layer_kv, 1, slots, out=out)


def _checked(pool: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
    """Validate the operands; returns `slots` as a contiguous int64 tensor on the pool's device."""
    if pool.dim() != 4 or pool.shape[0] != 2:
        raise ValueError(f"pool_layer_kv must be [2, num_slots, heads, head_dim], got {list(pool.shape)}")
    if pool.dtype not in DTYPES:
        raise ValueError(f"pool dtype {pool.dtype} is not one of {', '.join(map(str, DTYPES))}")
    heads, head_dim = pool.shape[2], pool.shape[3]
    if not (pool.stride(3) == 1 and pool.stride(2) == head_dim and pool.stride(1) == heads * head_dim):
        raise ValueError("pool_layer_kv rows must be contiguous (a layer of the KV pool is)")
    n = slots.numel()
    if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be a 1-D integer tensor, got {slots.dtype} of shape {list(slots.shape)}")
    if list(buffer.shape) != [2, n, *pool.shape[2:]]:
        raise ValueError(f"{name} must be {[2, n, *pool.shape[2:]]} for {n} slots, got {list(buffer.shape)}")
    if buffer.dtype != pool.dtype or buffer.device != pool.device:
        raise ValueError(f"{name} is {buffer.dtype} on {buffer.device}, the pool {pool.dtype} on {pool.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if n:
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= pool.shape[1]:
            raise ValueError(f"slots must lie in [0, {pool.shape[1]}), got [{low}, {high}]")
    slots = slots.to(dtype=torch.int64).contiguous()
    if pool.is_cuda and not slots.is_cuda:
        # From pinned memory the copy is queued; from pageable memory it would first wait for
        # all work queued on the GPU (the layer being computed, say).
        slots = slots.pin_memory().to(pool.device, non_blocking=True)
    return slots
