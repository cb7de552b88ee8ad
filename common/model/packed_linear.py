"""Linear layers whose fp32 or bf16 CPU weights are packed once for oneDNN.

Decode multiplies a handful of rows by large weight matrices. On the CPUs we serve from, MKL's
sgemm does that at a fraction of memory bandwidth, while oneDNN with the weight reordered once
into its blocked layout runs the same product about twice as fast (decode at batch 8 went from
0.97x to 0.54x the time of transformers; prefill is unchanged or faster). The packing ops are
torch's own (`torch.ops.mkldnn`, present in the pinned torch 2.13 CPU build). In bfloat16 the
packed product runs on AVX512-BF16 / AMX with float32 accumulation, the same instructions
vLLM's CPU backend uses. Other devices, float16, CPUs without bf16 support in oneDNN and torch
builds without oneDNN use `F.linear` on the original weight.

In bfloat16 on a CPU with AVX512-BF16, our own kernel (cpu/bf16_linear.cpp) takes every product
instead: at decode's few rows it streams the weights about 1.5x faster than oneDNN (the lm_head
at one row: 24 against 16 GB/s here), and it is no slower on prefill chunks.
Its rows are batch-invariant by construction (one accumulator per output, k in order), which a
bf16 hand-off needs: a prompt's last token is computed inside a chunk on one node and alone on
another, and must round alike.

A weight kept in its GGUF blocks (`--quantization gguf`, common/model/gguf_weight.py) is computed
by cpu/gguf_linear.cpp in float32, batch-invariant too; where the CPU kernels do not build it is
dequantized once and computed as above.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.gguf_weight import KINDS, GgufWeight
from cpu import extension as cpu_extension

# The batch size oneDNN tunes the packed layout for; decode batches are around this size.
BATCH_SIZE_HINT = 8


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def _bf16_kernel(weight: torch.Tensor):
    """`torch.ops.duet_cpu` when its bf16 kernel can take this weight, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[0] % 64 or weight.shape[1] % 2:
        return None
    ops = cpu_extension.kernels()
    return ops if ops is not None and cpu_extension.has_bf16_linear(ops) else None


def _gguf_kernel():
    """`torch.ops.duet_cpu` when it holds `gguf_linear`, else None."""
    ops = cpu_extension.kernels()
    return ops if ops is not None and hasattr(ops, "gguf_linear") else None


class Linear:
    """`y = x @ weight.T + bias` for 2-D `x`, with the weight packed when that is faster."""

    def __init__(self, weight: torch.Tensor | list[GgufWeight], bias: torch.Tensor | None = None) -> None:
        """`weight`: a tensor, or GGUF blocks (stacked parts, each of one block type)."""
        self.bias = bias
        self.gguf = _gguf_kernel() if isinstance(weight, list) else None
        if self.gguf is not None:
            self.parts = [(part.blocks, KINDS[part.tensor_type]) for part in weight]
            self.out_features = sum(blocks.shape[0] for blocks, _ in self.parts)
            self.bias = torch.empty(0) if bias is None else bias.float().contiguous()
            self.kernel, self.amx, self.packed = None, False, False
            return
        if isinstance(weight, list):
            weight = torch.cat([part.dequantized() for part in weight])
        self.out_features = weight.shape[0]
        self.kernel = _bf16_kernel(weight)
        self.amx = self.kernel is not None and cpu_extension.bf16_linear_uses_amx(self.kernel, weight.shape[1])
        self.packed = self.kernel is None and _can_pack(weight)
        if self.kernel is not None:
            self.weight = cpu_extension.pack_bf16_linear(weight)
            self.bias = torch.empty(0) if bias is None else bias.float()
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT)
        else:
            self.weight = weight

    @property
    def weight_bytes(self) -> int:
        """What one product reads of its weight."""
        tensors = [blocks for blocks, _ in self.parts] if self.gguf is not None else [self.weight]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def instructions(self) -> str:
        """What computes this layer's products: `amx` or `avx512_bf16` (cpu/bf16_linear.cpp),
        `onednn` (packed weights), `torch` (`F.linear`), or `gguf` (cpu/gguf_linear.cpp)."""
        if self.gguf is not None:
            return "gguf"
        if self.kernel is not None:
            return "amx" if self.amx else "avx512_bf16"
        return "onednn" if self.packed else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:  # float32 in and out; the engine's dtype around it
            x32, outs, at = x.float().contiguous(), [], 0
            for blocks, kind in self.parts:
                out = torch.empty(x.shape[0], blocks.shape[0])
                bias = self.bias[at : at + blocks.shape[0]] if self.bias.numel() else self.bias
                self.gguf.gguf_linear(x32, blocks, kind, bias, out)
                outs.append(out)
                at += blocks.shape[0]
            return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(x.dtype)
        if self.kernel is not None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
            self.kernel.bf16_linear(x.contiguous(), self.weight, self.bias, out, self.amx)
            return out
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            # oneDNN runs a one-row product through a kernel of its own whose sums round differently
            # from the one it runs at every other batch size (measured in bfloat16 on AVX512-BF16
            # without AMX: the 1536 -> 576 projection). A row must not change with its batch, or a
            # prompt's last token, computed alone after a hand-off and inside a chunk when prefilled
            # locally, samples differently: so one row goes as two. The weights are read once either way.
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.weight, self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
