"""GGUF tensors to float32 values.

gguf's own `quants.dequantize` is the reference for every type; it works through a tensor 16 rows
at a time from Python, which made dequantizing the embedded model most of a daemon's model load.
The block types most files hold (Q4_0, Q4_1, Q8_0, llama.cpp's `ggml-common.h` layouts) are
dequantized here over the whole tensor at once with torch, to the same bits (the same float32
products and sums); float types are copied; every other type goes to gguf.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# type -> (bytes per block of 32 values, whether the block stores a minimum after its scale)
_NIBBLE_BLOCKS = {Q.Q4_0: (18, False), Q.Q4_1: (20, True)}
_Q8_0_BLOCK = 34
_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of each block, as float32 `[blocks, 1]`."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def dequantize(data: np.ndarray, tensor_type: Q, shape: tuple[int, ...]) -> np.ndarray:
    """A writable float32 array of `shape` from a tensor's bytes or elements as GgufFile gives them."""
    if tensor_type in _FLOATS:
        raw = torch.from_numpy(data.view(np.uint8).copy()).view(_FLOATS[tensor_type])
        return raw.float().numpy().reshape(shape)
    if tensor_type in _NIBBLE_BLOCKS:
        size, has_min = _NIBBLE_BLOCKS[tensor_type]
        blocks = torch.from_numpy(data.view(np.uint8).reshape(-1, size).copy())
        packed = blocks[:, 4 if has_min else 2 :]
        # Value j of a block is the low nibble of byte j, value j + 16 the high nibble.
        nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
        if has_min:
            values = _halves(blocks, 0) * nibbles + _halves(blocks, 2)
        else:
            values = (nibbles - 8.0) * _halves(blocks, 0)
        return values.numpy().reshape(shape)
    if tensor_type == Q.Q8_0:
        blocks = torch.from_numpy(data.view(np.uint8).reshape(-1, _Q8_0_BLOCK).copy())
        return (_halves(blocks, 0) * blocks[:, 2:].view(torch.int8).float()).numpy().reshape(shape)
    return np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32)
