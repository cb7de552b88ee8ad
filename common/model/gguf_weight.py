"""A linear layer's weight kept in GGUF blocks (`--quantization gguf|int8|int4`).

Decode reads every weight once per step, so its speed is the bytes it reads: the embedded model's
Q4_1 blocks are 5 bits a weight where float32 is 32. The attention and MLP projections, the
lm_head and the embedding of a GGUF whose blocks are Q4_0, Q4_1, Q8_0, Q4_K or Q6_K stay in those
blocks: cpu/gguf_linear.cpp computes the products with them, each weight rebuilt to the very
value `gguf_dequant` gives it, and the embedding's rows are dequantized as a step looks them up;
every other tensor (norms, other block types) is dequantized at load as without the flag.

`int8` and `int4` quantize the projections of any checkpoint (a Hugging Face directory, or a
GGUF's dequantized values) at load into the same blocks: Q8_0 (a float16 scale per 32 weights,
int8 values) and Q4_1 (a float16 scale and minimum per 32 weights, 4-bit values), as llama.cpp
writes them (gguf's `quants.quantize`); the kernel is the same.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from common.model.gguf_dequant import dequantize

if TYPE_CHECKING:
    from common.model.checkpoint import Checkpoint

# Block types computed natively -> the kernel's `kind` (cpu/gguf_linear.cpp).
KINDS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q8_0: 2, Q.Q4_K: 3, Q.Q6_K: 4}
BLOCK = 32  # weights per block of Q4_0, Q4_1, Q8_0; the K types hold 256
AT_LOAD = {"int8": Q.Q8_0, "int4": Q.Q4_1}  # --quantization that quantizes at load -> its blocks
# The weights kept in blocks: the projections, the lm_head, and the embedding (its lookups
# dequantize the rows they read; a tied lm_head computes with its blocks).
NATIVE = ("_proj.weight", "model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class GgufWeight:
    """An `[out_features, in_features]` weight as the file's blocks, one row of blocks per output."""

    tensor_type: Q
    blocks: torch.Tensor  # [out_features, in_features / block weights * block bytes] uint8

    @property
    def shape(self) -> tuple[int, int]:
        weights, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return self.blocks.shape[0], self.blocks.shape[1] // size * weights

    @classmethod
    def of(cls, data: np.ndarray, tensor_type: Q, shape: tuple[int, ...]) -> GgufWeight | None:
        """A GGUF tensor's bytes as a GgufWeight; None when it is not a 2-D weight of a kind the
        kernel computes."""
        if tensor_type not in KINDS or len(shape) != 2 or shape[1] % gguf.GGML_QUANT_SIZES[tensor_type][0]:
            return None
        return cls(tensor_type, torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1).copy()))

    @staticmethod
    def cat(parts: list[GgufWeight]) -> list[GgufWeight]:
        """The weights' rows stacked (fused products), one weight per run of parts of one block
        type (a Q4_K_M file stores Q and K in Q4_K, V in Q6_K)."""
        runs = [[parts[0]]]
        for part in parts[1:]:
            if part.tensor_type is runs[-1][0].tensor_type:
                runs[-1].append(part)
            else:
                runs.append([part])
        return [GgufWeight(run[0].tensor_type, torch.cat([p.blocks for p in run])) for run in runs]

    @classmethod
    def quantized(cls, weight: torch.Tensor, tensor_type: Q) -> GgufWeight:
        """`weight` quantized into `tensor_type` blocks."""
        values = weight.float().numpy()
        return cls(tensor_type, torch.from_numpy(gguf.quants.quantize(values, tensor_type).reshape(weight.shape[0], -1)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` of the weight (an embedding's lookups), as `dequantized` has them."""
        return torch.from_numpy(dequantize(self.blocks[ids].numpy(), self.tensor_type, (len(ids), self.shape[1])))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight, as a load without `--quantization` makes it."""
        return torch.from_numpy(dequantize(self.blocks.numpy(), self.tensor_type, self.shape))


def quantized_at_load(ckpt: Checkpoint, quantization: str) -> Checkpoint:
    """`ckpt` with its 2-D NATIVE weights whose rows are whole blocks quantized into the blocks of
    `quantization` (AT_LOAD); the model hash says so."""
    kind = AT_LOAD[quantization]
    tensors = {name: GgufWeight.quantized(w, kind)
               if name.endswith(NATIVE) and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] % BLOCK == 0
               else w for name, w in ckpt.tensors.items()}
    return replace(ckpt, tensors=tensors, model_hash=f"{ckpt.model_hash};quantization={quantization}")
