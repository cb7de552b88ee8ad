"""Linear layers whose fp32 or bf16 CPU weights are packed once for oneDNN.

Decode multiplies a handful of rows by large weight matrices. On the CPUs we serve from, MKL's
sgemm does that at a fraction of memory bandwidth, while oneDNN with the weight reordered once
into its blocked layout runs the same product about twice as fast (decode at batch 8 went from
0.97x to 0.54x the time of transformers; prefill is unchanged or faster). The packing ops are
torch's own (`torch.ops.mkldnn`, present in the pinned torch 2.13 CPU build). In bfloat16 the
packed product runs on AVX512-BF16 / AMX with float32 accumulation, the same instructions
vLLM's CPU backend uses. Other devices, float16, CPUs without bf16 support in oneDNN and torch
builds without oneDNN use `F.linear` on the original weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


class Linear:
    """`y = x @ weight.T + bias` for 2-D `x`, with the weight packed when that is faster."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
