"""The feed-forward half of a decoder layer: a gated MLP, or a mixture of such experts.

A mixture runs each expert only on the rows routed to it (grouped by expert, as transformers'
own loop does), so a step costs its k experts per token rather than every expert; each row's sum
over its experts is taken in expert order, whatever else is in the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.config import MoeConfig
from common.model.packed_linear import Linear


class GatedMlp:
    """`down(act(gate) * up)`, gate and up computed as one product."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str, moe: MoeConfig | None = None) -> None:
        if activation not in ("silu", "gelu_tanh", "clamped_swiglu"):
            raise ValueError(f"unsupported activation {activation!r}")
        self.gate_up, self.down, self.activation = gate_up, down, activation
        self.limit, self.alpha = (moe.swiglu_limit, moe.swiglu_alpha) if moe is not None else (None, None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        if self.activation == "silu":
            return self.down(F.silu(gate) * up)
        if self.activation == "gelu_tanh":
            return self.down(F.gelu(gate, approximate="tanh") * up)
        # gpt-oss: gate clamped above, up clamped both ways, then (up + 1) * gate * sigmoid(alpha * gate)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class MixtureOfExperts:
    """Each row through the `top_k` experts its router picks, summed with the routing weights."""

    def __init__(self, router: Linear, experts: list[GatedMlp], moe: MoeConfig, routing: str) -> None:
        if routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unsupported expert routing {routing!r}")
        self.router, self.experts, self.moe, self.routing = router, experts, moe, routing

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights `[T, k]` and expert indices `[T, k]` of each row."""
        logits = self.router(h).float()
        if self.routing == "topk_softmax":  # gpt-oss: a softmax over the k largest logits
            top, index = logits.topk(self.moe.top_k, dim=-1)
            return top.softmax(dim=-1), index
        weights, index = logits.softmax(dim=-1).topk(self.moe.top_k, dim=-1)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, index = self.route(h)
        out = torch.zeros_like(h)
        for expert in index.unique().tolist():
            rows, slot = (index == expert).nonzero(as_tuple=True)
            y = self.experts[expert](h.index_select(0, rows)).float() * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(h.dtype))
        return out
