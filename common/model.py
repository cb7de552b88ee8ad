"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) with paged attention.

Attention reads and writes K/V only through slot indices of a `KVPool`; no per-sequence
contiguous cache exists. One forward can mix sequences that are prefilling a chunk and
sequences that are decoding one token:
- decoding sequences are attended together, padded to the longest context, with the query
  heads grouped by KV head so grouped-query attention needs no K/V repetition;
- each prefilling chunk is attended on its own, causally, over its whole context.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.checkpoint import Checkpoint
from common.kv_pool import KVPool
from common.packed_linear import Linear


@dataclass
class SequenceSlice:
    """One sequence's share of a forward: `num_new` query tokens at the end of a context of
    `context_len` tokens whose K/V live at `context_slots` (new tokens included)."""

    num_new: int
    context_slots: torch.Tensor  # [context_len] long
    # [num_new, context_len] bool: which context keys each new token attends (sliding windows,
    # common/attention_window.py); None = causal attention over the whole context.
    mask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.context_slots.numel()


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long: the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] long
    slices: list[SequenceSlice]
    logit_rows: torch.Tensor  # [R] long: rows of T whose next-token logits are wanted

    @property
    def write_slots(self) -> torch.Tensor:
        return torch.cat([s.context_slots[s.context_len - s.num_new :] for s in self.slices])


class _AttentionPlan:
    """Index tensors shared by every layer of one forward."""

    def __init__(self, batch: ForwardBatch, device: torch.device) -> None:
        self.write_slots = batch.write_slots.to(device)
        offsets, start = [], 0
        for s in batch.slices:
            offsets.append(start)
            start += s.num_new
        decode = [(o, s) for o, s in zip(offsets, batch.slices) if s.num_new == 1]
        self.prefill = [(o, s.num_new, s.context_slots.to(device), _causal_mask(s, device))
                        for o, s in zip(offsets, batch.slices) if s.num_new > 1]
        self.decode_rows = torch.tensor([o for o, _ in decode], dtype=torch.long, device=device)
        if decode:
            longest = max(s.context_len for _, s in decode)
            slots = torch.zeros(len(decode), longest, dtype=torch.long)
            mask = torch.zeros(len(decode), longest, dtype=torch.bool)
            for i, (_, s) in enumerate(decode):
                slots[i, : s.context_len] = s.context_slots
                mask[i, : s.context_len] = True if s.mask is None else s.mask[0]
            self.decode_slots = slots.to(device)
            self.decode_mask = mask[:, None, None, :].to(device)


def _causal_mask(s: SequenceSlice, device: torch.device) -> torch.Tensor | None:
    """The slice's own mask if it has one; else None when the chunk is the whole context
    (plain causal attention)."""
    if s.mask is not None:
        return s.mask.to(device)
    if s.num_new == s.context_len:
        return None
    q_pos = torch.arange(s.context_len - s.num_new, s.context_len, device=device)
    return torch.arange(s.context_len, device=device)[None, :] <= q_pos[:, None]


class LlamaModel:
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
        self.rope_cos = angles.cos().to(device=device, dtype=dtype)
        self.rope_sin = angles.sin().to(device=device, dtype=dtype)

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        cfg = self.config
        return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, self.dtype, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the pool and return `[R, vocab]` fp32 logits.

        `on_layer_done(layer)` runs as soon as a layer's K/V is in the pool, so a transport
        can ship that layer while later layers compute.
        """
        cfg = self.config
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        plan = _AttentionPlan(batch, self.device)
        positions = batch.positions.to(self.device)
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        x = self.embed[batch.token_ids.to(self.device)]
        T = x.shape[0]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["in_norm"])
            qkv = layer["qkv"](h)
            q = qkv[:, : nh * hd].view(T, nh, hd)
            k = qkv[:, nh * hd : (nh + kvh) * hd].view(T, kvh, hd)
            v = qkv[:, (nh + kvh) * hd :].view(T, kvh, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = pool.keys(i), pool.values(i)
            keys.index_copy_(0, plan.write_slots, k)
            values.index_copy_(0, plan.write_slots, v)
            attn = self._attention(q, keys, values, plan)
            x = x + layer["o"](attn.view(T, nh * hd))
            h = self._rms_norm(x, layer["post_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
            if on_layer_done is not None:
                on_layer_done(i)
        rows = batch.logit_rows.to(self.device)
        return self.lm_head(self._rms_norm(x[rows], self.norm)).float()

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: _AttentionPlan) -> torch.Tensor:
        nh, kvh, hd = q.shape[1], keys.shape[1], q.shape[2]
        out = torch.empty_like(q)
        if plan.decode_rows.numel():
            b = plan.decode_rows.numel()
            # Query heads grouped by the KV head they share: [B, kvh, group, hd].
            qd = q[plan.decode_rows].view(b, kvh, nh // kvh, hd)
            # index_select on the flat slot list is several times faster than advanced indexing.
            flat = plan.decode_slots.view(-1)
            kd = keys.index_select(0, flat).view(b, -1, kvh, hd).transpose(1, 2)
            vd = values.index_select(0, flat).view(b, -1, kvh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)
            out[plan.decode_rows] = o.reshape(b, nh, hd)
        for start, n, slots, mask in plan.prefill:
            qp = q[start : start + n].transpose(0, 1)[None]
            kp = keys.index_select(0, slots).transpose(0, 1)[None]
            vp = values.index_select(0, slots).transpose(0, 1)[None]
            if mask is not None and qp.is_cuda and nh != kvh:
                o = grouped_query_attention(qp, kp, vp, mask)
            else:
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
        return out


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention of `q` `[1, nh, n, hd]` over `k`, `v` `[1, kvh, L, hd]` with a `[n, L]`
    mask, as `enable_gqa=True` computes it, but with the query heads that share a KV head stacked
    along the sequence: `[1, kvh, group * n, hd]` against plain multi-head K/V.

    On CUDA, flash attention takes no mask and the memory-efficient kernel no `enable_gqa`, so a
    masked chunk (one after cached context, or under a sliding window) with GQA would fall to
    the math kernel, which materialises every head's fp32 scores. Stacked, the memory-efficient
    kernel applies, and K/V are not copied. On the CPU `enable_gqa` is faster, so it stays there.
    """
    _, nh, n, hd = q.shape
    kvh = k.shape[1]
    stacked = q.reshape(1, kvh, nh // kvh * n, hd)  # head h = kv head h // group, as in transformers
    o = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask.repeat(nh // kvh, 1))
    return o.view(1, nh, n, hd)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
