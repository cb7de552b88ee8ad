"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) with paged attention.

Attention reads and writes K/V only through slot indices of a `KVPool`; no per-sequence
contiguous cache exists. One forward can mix sequences that are prefilling a chunk and
sequences that are decoding one token (common/model/paged_attention.py attends them).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kv.pool import KVPool
from common.model.checkpoint import Checkpoint
from common.model.packed_linear import Linear
from common.model.paged_attention import AttentionPlan, SequenceSlice, attend, grouped_query_attention, kernel_enabled
from cpu import extension as cpu_extension

__all__ = ["ForwardBatch", "DecoderModel", "SequenceSlice", "grouped_query_attention"]  # the last two: re-exported


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long: the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] long
    slices: list[SequenceSlice]
    logit_rows: torch.Tensor  # [R] long: rows of T whose next-token logits are wanted

    @property
    def write_slots(self) -> torch.Tensor:
        return torch.cat([s.context_slots[s.context_len - s.num_new :] for s in self.slices])


def _rope_table(f, angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos or sin of the float32 `angles`, in `dtype`. float32 keeps torch's float32 functions
    (what transformers computes, token for token). Below float32 the value is taken in float64
    and rounded once: torch's float32 cos over this table did not give the same bits in every
    process (in about 1 in 20 processes on a loaded 2-core AMX machine some entries differed,
    and a bf16 stream then parted from another node's at a near-tie), while a float64 value's
    last-bit noise never reaches a bf16 rounding."""
    if dtype == torch.float32:
        return f(angles)
    return f(angles.double()).to(dtype)


class DecoderModel:
    """Inference-only weights and forward; parameters are fused (QKV, gate+up) for speed."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        cfg = self.config = ckpt.config
        self.model_hash = ckpt.model_hash
        self.dtype, self.device = dtype, torch.device(device)
        w = ckpt.tensors

        def put(t: torch.Tensor) -> torch.Tensor:
            # Fused (concatenated) where the checkpoint lives, then moved once: fusing on a GPU
            # would leave the unfused copies as cached blocks the KV pool cannot reuse.
            return t.to(device=device, dtype=dtype)

        self.embed = put(w["model.embed_tokens.weight"])
        self.norm = put(w["model.norm.weight"])
        # Tied: the packed copy costs the embedding's size again (113 MB for SmolLM2-135M), for the
        # largest product of every step.
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else put(w["lm_head.weight"]))
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = [w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
            bias = None
            if cfg.attention_bias:
                bias = put(torch.cat([w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]))
            self.layers.append({
                "in_norm": put(w[f"{p}input_layernorm.weight"]),
                "qkv": Linear(put(torch.cat(attn)), bias),
                "o": Linear(put(w[f"{p}self_attn.o_proj.weight"])),
                "post_norm": put(w[f"{p}post_attention_layernorm.weight"]),
                "gate_up": Linear(put(torch.cat([w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"]]))),
                "down": Linear(put(w[f"{p}mlp.down_proj.weight"])),
            })
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), cfg.rope_inv_freq())
        angles = torch.cat([angles, angles], dim=-1)
        self.rope_cos, self.rope_sin = (_rope_table(f, angles, dtype).to(device) for f in (torch.cos, torch.sin))
        # Read K/V in place with the CPU kernel when it builds (common/model/paged_attention.py).
        self.attention_kernel = kernel_enabled(self.device, dtype)
        # A bf16 CPU layer's RMSNorm and RoPE as one call each (cpu/bf16_pointwise.cpp), rounding as
        # the torch ops below do: at decode's few rows their dispatches cost more than their math.
        self.pointwise = cpu_extension.kernels() if self.device.type == "cpu" and dtype == torch.bfloat16 else None

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        cfg = self.config
        return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, self.dtype, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.pointwise is not None:
            out = torch.empty_like(x)
            self.pointwise.rms_norm_bf16(x.contiguous(), weight, self.config.rms_norm_eps, out)
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        # Below float32 the statistics are taken in float32 and the weight applied after rounding
        # back, in the order transformers' LlamaRMSNorm uses.
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.config.rms_norm_eps).to(x.dtype) * weight

    def _split_rotated(self, qkv: torch.Tensor, positions: torch.Tensor,
                       angles: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """q `[T, nh, hd]` (contiguous: attention reads it as one block), k and v `[T, kvh, hd]`
        of a fused QKV product, RoPE applied to q and k: by the bf16 kernel in place, or with
        torch ops and `angles` (cos, sin at each position)."""
        cfg = self.config
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = qkv.shape[0]
        if angles is None:
            self.pointwise.rope_bf16_(qkv, positions, self.rope_cos, self.rope_sin, nh + kvh)
        q = qkv[:, : nh * hd].view(T, nh, hd)
        k = qkv[:, nh * hd : (nh + kvh) * hd].view(T, kvh, hd)
        v = qkv[:, (nh + kvh) * hd :].view(T, kvh, hd)
        if angles is None:
            return q.contiguous(), k, v
        cos, sin = angles
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the pool and return `[R, vocab]` fp32 logits (none
        computed when `logit_rows` is empty).

        `on_layer_done(layer)` runs as soon as a layer's K/V is in the pool, so a transport
        can ship that layer while later layers compute.
        """
        cfg = self.config
        nh, hd = cfg.num_heads, cfg.head_dim
        plan = AttentionPlan(batch.slices, self.device, self.attention_kernel)
        write_slots = batch.write_slots.to(self.device)
        positions = batch.positions.to(self.device)
        # The torch path's rotation angles, gathered once for every layer (the kernel indexes them).
        angles = None
        if self.pointwise is None:
            angles = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        x = self.embed[batch.token_ids.to(self.device)]
        T = x.shape[0]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["in_norm"])
            q, k, v = self._split_rotated(layer["qkv"](h), positions, angles)
            keys, values = pool.keys(i), pool.values(i)
            keys.index_copy_(0, write_slots, k)
            values.index_copy_(0, write_slots, v)
            attn = attend(q, keys, values, plan)
            x = x + layer["o"](attn.view(T, nh * hd))
            h = self._rms_norm(x, layer["post_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
            if on_layer_done is not None:
                on_layer_done(i)
        rows = batch.logit_rows.to(self.device)
        if not rows.numel():
            return torch.empty(0, cfg.vocab_size, device=self.device)
        return self.lm_head(self._rms_norm(x[rows], self.norm)).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
