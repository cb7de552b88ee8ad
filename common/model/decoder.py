"""The decoder of every family in common/model/family.py, with paged attention.

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
from common.model.family import family_of
from common.model.gguf_weight import GgufWeight
from common.model.mlp import GatedMlp, MixtureOfExperts
from common.model.packed_linear import Linear
from common.model.paged_attention import (AttentionPlan, SequenceSlice, attend, grouped_query_attention, kernel_enabled,
                                          within_window)
from cpu import extension as cpu_extension

__all__ = ["ForwardBatch", "DecoderModel", "SequenceSlice", "grouped_query_attention"]  # the last two: re-exported


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long: the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] long: each token's rope row, its position (+ DecoderModel.long_rope_offset)
    slices: list[SequenceSlice]
    logit_rows: torch.Tensor  # [R] long: rows of T whose next-token logits are wanted
    # A pool with a sliding group (common/kv/pool.py): full slots -> the sliding layers' slots.
    sliding_slots: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def write_slots(self) -> torch.Tensor:
        return torch.cat([s.context_slots[s.context_len - s.num_new :] for s in self.slices])


def _rope_table(f, angles: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> torch.Tensor:
    """cos or sin of the float32 `angles` times `factor` (YaRN's), in `dtype`. float32 keeps torch's float32 functions
    (what transformers computes, token for token). Below float32 the value is taken in float64
    and rounded once: torch's float32 cos over this table did not give the same bits in every
    process (in about 1 in 20 processes on a loaded 2-core AMX machine some entries differed,
    and a bf16 stream then parted from another node's at a near-tie), while a float64 value's
    last-bit noise never reaches a bf16 rounding."""
    if dtype == torch.float32:
        return f(angles) * factor if factor != 1.0 else f(angles)
    return (f(angles.double()) * factor).to(dtype)


class DecoderModel:
    """Inference-only weights and forward; parameters are fused (QKV, gate+up) for speed. What the
    family changes (norm placement and style, q/k norms, activation, experts, scales, soft-capping,
    windows per layer) is read from its declaration (common/model/family.py) and config."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        cfg = self.config = ckpt.config
        family = self.family = family_of(cfg.architecture)
        self.model_hash = ckpt.model_hash
        self.dtype, self.device = dtype, torch.device(device)
        weights = _Weights(ckpt, dtype, device)
        embed = weights.tensors["model.embed_tokens.weight"]
        # In GGUF blocks (--quantization), the rows a step looks up are dequantized as it needs them.
        self.embed = embed if isinstance(embed, GgufWeight) and self.device.type == "cpu" else \
            weights.put(embed.dequantized() if isinstance(embed, GgufWeight) else embed)
        # Gemma's factor is rounded to the model dtype first, as transformers does.
        self.embedding_multiplier = (torch.tensor(cfg.embedding_multiplier, dtype=dtype).item()
                                     if family.embedding_scale else cfg.embedding_multiplier)
        self.norm = weights.norm("model.norm.weight")
        # Tied: the packed copy costs the embedding's size again (113 MB for SmolLM2-135M), for the
        # largest product of every step; kept in its GGUF blocks, a quarter of that.
        tied = embed if isinstance(embed, GgufWeight) else self.embed
        self.lm_head = weights.linear(tied if cfg.tie_word_embeddings else weights.tensors["lm_head.weight"])
        self.layers = [weights.layer(i) for i in range(cfg.num_layers)]
        self.windows = {layer["window"] for layer in self.layers}  # None: full attention
        # A hybrid model's sliding layers, which may keep their K/V in a group of their own.
        self.sliding_layers = tuple(i for i, w in enumerate(cfg.layer_windows or ()) if w is not None)
        self.attention_scale = cfg.attention_scale or cfg.head_dim**-0.5
        # Soft-capped scores and sinks are computed as transformers' eager attention does.
        self.eager_attention = cfg.attention_softcap is not None or any("sinks" in layer for layer in self.layers)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        # Longrope: the long factors' rows follow the short ones', so a sequence computing with them
        # reads row `position + long_rope_offset` (the engine's rope rows, ForwardBatch.positions).
        self.long_rope_offset = 0 if cfg.long_rope_from is None else cfg.max_position_embeddings
        self.rope_tables = {}  # sliding or not -> (cos, sin) `[rope rows, rotary_dim]`
        for sliding in {False, cfg.sliding_rope_theta is not None}:
            tables = []
            for long in (False, True) if self.long_rope_offset else (False,):
                inv_freq, factor = cfg.rope(sliding, long)
                angles = torch.outer(positions, inv_freq)
                angles = torch.cat([angles, angles], dim=-1)
                tables.append([_rope_table(f, angles, dtype, factor) for f in (torch.cos, torch.sin)])
            self.rope_tables[sliding] = tuple(torch.cat(rows).to(device) for rows in zip(*tables))
        # Read K/V in place with the CPU kernel when it builds (common/model/paged_attention.py).
        self.attention_kernel = kernel_enabled(self.device, dtype) and not self.eager_attention
        # A bf16 CPU layer's RMSNorm and RoPE as one call each (cpu/bf16_pointwise.cpp), rounding as
        # the torch ops below do: at decode's few rows their dispatches cost more than their math.
        bf16_cpu = self.device.type == "cpu" and dtype == torch.bfloat16
        self.pointwise = cpu_extension.kernels() if bf16_cpu else None
        self.pointwise_norm = self.pointwise is not None and not family.norm_weight_in_float32
        self.pointwise_rope = self.pointwise is not None and cfg.rotary_dim == cfg.head_dim

    @property
    def rope_cos(self) -> torch.Tensor:
        """The full-attention layers' cos table (the one every layer of most models uses)."""
        return self.rope_tables[False][0]

    @property
    def rope_sin(self) -> torch.Tensor:
        return self.rope_tables[False][1]

    def new_pool(self, num_pages: int, page_size: int, sliding_pages: int = 0) -> KVPool:
        """With `sliding_pages`, a hybrid model's sliding layers get a group of their own."""
        cfg = self.config
        return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, self.dtype, self.device,
                      self.sliding_layers, sliding_pages)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dimension, the weight applied as the family's norm does."""
        eps = self.config.rms_norm_eps
        if self.pointwise_norm and x.dim() == 2:
            out = torch.empty_like(x)
            self.pointwise.rms_norm_bf16(x.contiguous(), weight, eps, out)
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        if weight.dtype == torch.float32:  # Gemma, OLMo 2, gpt-oss: the weight applied in float32, rounded once
            return (normed * weight).to(x.dtype)
        # Llama: the statistics taken in float32, the weight applied after rounding back.
        return normed.to(x.dtype) * weight

    def _qkv(self, layer: dict, h: torch.Tensor, positions: torch.Tensor,
             angles: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None) -> tuple[torch.Tensor, ...]:
        """q `[T, nh, hd]` (contiguous: attention reads it as one block), k and v `[T, kvh, hd]`,
        q/k normalised where the family does and rotated: by the bf16 kernel in place, or with
        torch ops and `angles` (cos, sin at each position, per kind of layer)."""
        cfg = self.config
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = layer["qkv"](h)
        T = qkv.shape[0]
        if "q_norm" in layer:
            for width, first, norm in ((nh * hd, 0, layer["q_norm"]), (kvh * hd, nh * hd, layer["k_norm"])):
                part = qkv[:, first : first + width]
                shaped = part.reshape(-1, hd) if self.family.qk_norm == "head" else part
                part.copy_(self._rms_norm(shaped, norm).view(T, width))
        sliding = layer["window"] is not None and len(self.rope_tables) > 1
        if angles is None:
            cos, sin = self.rope_tables[sliding]
            self.pointwise.rope_bf16_(qkv, positions, cos, sin, nh + kvh)
        q = qkv[:, : nh * hd].view(T, nh, hd)
        k = qkv[:, nh * hd : (nh + kvh) * hd].view(T, kvh, hd)
        v = qkv[:, (nh + kvh) * hd :].view(T, kvh, hd)
        if angles is None:
            return q.contiguous(), k, v
        cos, sin = angles[sliding]
        return _rotate(q, cos, sin).contiguous(), _rotate(k, cos, sin), v

    def _plans(self, batch: ForwardBatch) -> dict[int | None, AttentionPlan]:
        """One attention plan per window the layers use (None: the batch's slices as given); a
        hybrid model's sliding layers read their own group's slots where the pool has one."""
        plans = {}
        for window in self.windows:
            slices = batch.slices if window is None or self.config.layer_windows is None else [
                within_window(s, window, batch.sliding_slots) for s in batch.slices]
            plans[window] = AttentionPlan(slices, self.device, self.attention_kernel, self.eager_attention)
        return plans

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
        plans = self._plans(batch)
        write_slots = batch.write_slots
        slots_of = {False: write_slots.to(self.device)}  # by layer group: sliding or not
        if batch.sliding_slots is not None:
            slots_of[True] = batch.sliding_slots(write_slots).to(self.device)
        positions = batch.positions.to(self.device)
        # The torch path's rotation angles, gathered once for every layer (the kernel indexes them).
        angles = None
        if not self.pointwise_rope:
            angles = {kind: (cos[positions][:, None, :], sin[positions][:, None, :])
                      for kind, (cos, sin) in self.rope_tables.items()}
        ids = batch.token_ids.to(self.device)
        x = self.embed.rows(ids).to(self.dtype) if isinstance(self.embed, GgufWeight) else self.embed[ids]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        T = x.shape[0]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["attn_in"]) if "attn_in" in layer else x
            q, k, v = self._qkv(layer, h, positions, angles)
            keys, values, slots = pool.keys(i), pool.values(i), slots_of[pool.is_sliding(i)]
            keys.index_copy_(0, slots, k)
            values.index_copy_(0, slots, v)
            attn = attend(q, keys, values, plans[layer["window"]], self.attention_scale, cfg.attention_softcap,
                          layer.get("sinks"))
            x = self._residual(x, layer["o"](attn.view(T, nh * hd)), layer.get("attn_out"))
            h = self._rms_norm(x, layer["mlp_in"]) if "mlp_in" in layer else x
            x = self._residual(x, layer["mlp"](h), layer.get("mlp_out"))
            if on_layer_done is not None:
                on_layer_done(i)
        rows = batch.logit_rows.to(self.device)
        if not rows.numel():
            return torch.empty(0, cfg.vocab_size, device=self.device)
        logits = self.lm_head(self._rms_norm(x[rows], self.norm)).float()
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def _residual(self, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """x plus a sub-layer's output, normalised first where the family does (Gemma, OLMo 2)
        and scaled by the residual multiplier (Granite)."""
        if norm is not None:
            out = self._rms_norm(out, norm)
        if self.config.residual_multiplier != 1.0:
            out = out * self.config.residual_multiplier
        return x + out


class _Weights:
    """A checkpoint's tensors as the forward holds them: on the model's device in its dtype,
    products fused (QKV, gate+up) and packed (Linear), norms as the family applies them."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: str) -> None:
        self.tensors, self.config, self.family = ckpt.tensors, ckpt.config, family_of(ckpt.config.architecture)
        self.dtype, self.device = dtype, device

    def put(self, t: torch.Tensor) -> torch.Tensor:
        # Fused (concatenated) where the checkpoint lives, then moved once: fusing on a GPU
        # would leave the unfused copies as cached blocks the KV pool cannot reuse.
        return t.to(device=self.device, dtype=self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        if not self.family.norm_weight_in_float32:
            return self.put(self.tensors[name])
        # The weight as the model dtype holds it, applied in float32 (plus Gemma's offset).
        return self.tensors[name].to(self.dtype).float().to(self.device) + self.family.norm_weight_offset

    def fused(self, names: list[str]) -> Linear:
        """One Linear computing the named products side by side (with their biases, when they have them)."""
        biases = [self.tensors.get(f"{name}.bias") for name in names]
        bias = None if biases[0] is None else self.put(torch.cat(biases))
        weights = [self.tensors[f"{name}.weight"] for name in names]
        if all(isinstance(w, GgufWeight) for w in weights):
            return self.linear(GgufWeight.cat(weights), bias)
        return self.linear(torch.cat([w.dequantized() if isinstance(w, GgufWeight) else w for w in weights]), bias)

    def linear(self, weight: torch.Tensor | GgufWeight | list[GgufWeight], bias: torch.Tensor | None = None) -> Linear:
        """A product of `weight`: kept in its GGUF blocks on a CPU, else in the model's dtype."""
        if isinstance(weight, GgufWeight):
            weight = [weight]
        if isinstance(weight, list):
            if torch.device(self.device).type == "cpu":
                return Linear(weight, bias)
            weight = torch.cat([part.dequantized() for part in weight])
        return Linear(self.put(weight), bias)

    def gated(self, p: str) -> GatedMlp:
        return GatedMlp(self.fused([f"{p}gate_proj", f"{p}up_proj"]), self.fused([f"{p}down_proj"]),
                        self.family.activation, self.config.moe)

    def layer(self, i: int) -> dict:
        """Layer i's weights, keyed by what the forward looks up; the norms the family has, by role."""
        cfg, family, p = self.config, self.family, f"model.layers.{i}."
        layer = {"qkv": self.fused([f"{p}self_attn.{n}_proj" for n in "qkv"]),
                 "o": self.fused([f"{p}self_attn.o_proj"]), "window": cfg.window_of(i)}
        layer |= {role: self.norm(f"{p}{name}.weight") for role, name in family.norms.items()}
        if family.qk_norm is not None:
            layer |= {"q_norm": self.norm(f"{p}self_attn.q_norm.weight"),
                      "k_norm": self.norm(f"{p}self_attn.k_norm.weight")}
        if f"{p}self_attn.sinks" in self.tensors:  # gpt-oss: a learned logit per head, a share of the softmax
            layer["sinks"] = self.tensors[f"{p}self_attn.sinks"].float().to(self.device)
        if cfg.moe is not None and i not in cfg.moe.dense_layers:
            experts = [self.gated(f"{p}mlp.experts.{e}.") for e in range(cfg.moe.num_experts)]
            layer["mlp"] = MixtureOfExperts(self.fused([f"{p}mlp.gate"]), experts, cfg.moe, family.routing)
        else:
            layer["mlp"] = self.gated(f"{p}mlp.")
        return layer


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading `cos.shape[-1]` dimensions of each head (all of them but with a partial
    rotary factor), rotate-half style."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated = x[..., :d] * cos + _rotate_half(x[..., :d]) * sin
    return torch.cat([rotated, x[..., d:]], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
