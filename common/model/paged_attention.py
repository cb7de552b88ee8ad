"""Attention over the paged KV pool for one forward's mix of decoding and prefilling sequences.

Two implementations compute the same thing:
- the CPU kernel (cpu/paged_attention.cpp, `torch.ops.duet_cpu.paged_attention`), which reads
  each key and value where it lies in the pool: no per-step copy of every sequence's context;
- the torch fallback, which gathers each context with `index_select` and runs
  `scaled_dot_product_attention` (decoding sequences together, padded to the longest context,
  query heads grouped by KV head; each prefilling chunk on its own).

`AttentionPlan` is built once per forward (its index tensors serve every layer) and decides which
sequences each implementation takes: the kernel takes every sequence of a float32 or bfloat16 CPU forward
when it built (cpu/extension.py) except prefill chunks of more than `KERNEL_MAX_QUERIES` tokens,
where blocked matrix products win and one gather per layer costs little against the chunk's
compute: on AVX512-BF16 CPUs a bfloat16 chunk over its whole causal context goes to
cpu/prefill_attention.cpp (on AMX tiles where the CPU has them: at 1000 tokens, on one Sapphire
Rapids core, 6-11 ms a layer against SDPA's 8-12 and the AVX512-BF16 path's 22; and a row's
result never depends on how its prompt was chunked), every other chunk to SDPA. A CUDA paged-attention kernel would join
here the same way: a plan field for the sequences it takes and a branch in `attend`.

A model whose scores are soft-capped (Gemma 2) or share the softmax with learned sinks (gpt-oss)
takes a third, eager path for every sequence: the scores materialised in float32, as
transformers' eager attention computes them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpu import extension as cpu_extension

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 K/V are widened as read; sums in float32
KERNEL_MAX_QUERIES = 2  # longer prefill chunks go to SDPA, faster from 4 queries on (docs/bench/README.md)
PREFILL_KERNEL_HEAD_DIMS = (64, 128)  # what cpu/prefill_attention.cpp is compiled for


@dataclass
class SequenceSlice:
    """One sequence's share of a forward: `num_new` query tokens at the end of a context of
    `context_len` tokens whose K/V live at `context_slots` (new tokens included)."""

    num_new: int
    context_slots: torch.Tensor  # [context_len] long
    # [num_new, context_len] bool: which context keys each new token attends (sliding windows,
    # common/engine/attention_window.py); None = causal attention over the whole context.
    mask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.context_slots.numel()


def kernel_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether forwards on `device` in `dtype` can use the CPU kernel (building it at first call)."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and cpu_extension.kernels() is not None


class _KernelArgs:
    """The kernel's index tensors for the sequences it takes (see cpu/paged_attention.cpp)."""

    def __init__(self, taken: list[tuple[int, SequenceSlice]]) -> None:
        self.rows = torch.cat([torch.arange(o, o + s.num_new) for o, s in taken])
        self.contiguous = bool(self.rows[-1] - self.rows[0] + 1 == self.rows.numel())
        seqs, masks, mask_at, ctx, q, mask_len = [], [], [], 0, 0, 0
        for _, s in taken:
            seqs.append((q, s.num_new, ctx, s.context_len))
            q += s.num_new
            ctx += s.context_len
            if s.mask is None:
                mask_at.append(-1)
            else:
                mask_at.append(mask_len)
                masks.append(s.mask.reshape(-1))
                mask_len += s.mask.numel()
        self.slots = torch.cat([s.context_slots for _, s in taken])
        self.seqs = torch.tensor(seqs, dtype=torch.long)
        self.masks = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        self.mask_at = torch.tensor(mask_at, dtype=torch.long)


def window_keys(first_query: int, end: int, size: int, sinks: int = 0) -> torch.Tensor:
    """Ascending key positions that queries at `[first_query, end)` attend under a sliding window
    of `size` (a query at i: keys in (i - size, i]) with `sinks` leading positions every query
    attends too: the sinks, then `[first_query - size + 1, end)`."""
    low = max(0, first_query - size + 1)
    return torch.cat([torch.arange(min(sinks, low)), torch.arange(low, end)])


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, size: int, sinks: int = 0) -> torch.Tensor:
    """`[queries, keys]` bool: True where a query attends a key under that window and sinks."""
    q, k = query_positions[:, None], key_positions[None, :]
    return (k <= q) & ((k > q - size) | (k < sinks))


def within_window(s: SequenceSlice, window: int,
                  sliding_slots: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SequenceSlice:
    """A causal slice over its whole context as a layer with a sliding `window` attends it (a
    hybrid model's sliding layers), its keys' slots mapped by `sliding_slots` where the pool keeps
    those layers in a group of their own."""
    assert s.mask is None, "a slice with its own mask is already windowed"
    first_query = s.context_len - s.num_new
    keys = window_keys(first_query, s.context_len, window)
    slots = s.context_slots[keys]
    return SequenceSlice(s.num_new, slots if sliding_slots is None else sliding_slots(slots),
                         window_mask(torch.arange(first_query, s.context_len), keys, window))


class AttentionPlan:
    """Index tensors shared by every layer of one forward. `offsets[i]` is the first row of
    slice i's new tokens in the forward's `[T, ...]` activations. With `eager`, every slice goes
    to the eager path (`self.eager`: first row, tokens, context slots, mask or None for causal)."""

    def __init__(self, slices: Sequence[SequenceSlice], device: torch.device, use_kernel: bool,
                 eager: bool = False) -> None:
        offsets, start = [], 0
        for s in slices:
            offsets.append(start)
            start += s.num_new
        pairs = list(zip(offsets, slices))
        self.eager = None
        if eager:
            self.eager = [(o, s.num_new, s.context_slots.to(device), _causal_mask(s, device)) for o, s in pairs]
            use_kernel, pairs = False, []
        taken = [(o, s) for o, s in pairs if use_kernel and s.num_new <= KERNEL_MAX_QUERIES]
        self.kernel = _KernelArgs(taken) if taken else None
        rest = [(o, s) for o, s in pairs if not (use_kernel and s.num_new <= KERNEL_MAX_QUERIES)]
        decode = [(o, s) for o, s in rest if s.num_new == 1]
        # (first row, tokens, context slots, mask, whether the mask is plain causal attention)
        self.prefill = [(o, s.num_new, s.context_slots.to(device), _causal_mask(s, device), s.mask is None)
                        for o, s in rest if s.num_new > 1]
        ops = cpu_extension.kernels() if use_kernel else None
        self.prefill_kernel = ops is not None and cpu_extension.has_bf16_prefill_attention(ops)
        self.prefill_amx = self.prefill_kernel and cpu_extension.bf16_prefill_attention_uses_amx(ops)
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


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
           scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, nh, hd]` attention outputs of queries `q` `[T, nh, hd]` over one layer's pool
    `keys`/`values` `[num_slots, kvh, hd]`; scores scaled by `scale` (default `hd ** -0.5`),
    soft-capped at `softcap`, with a per-head sink logit `sinks` `[nh]` in the softmax (the
    last two need a plan made with `eager`)."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if plan.eager is not None:
        for start, n, slots, mask in plan.eager:
            _attend_eager(q, keys, values, start, n, slots, mask, scale, softcap, sinks, out)
        return out
    assert softcap is None and sinks is None, "soft-capping and sinks need an eager plan"
    if plan.kernel is not None:
        _attend_kernel(q, keys, values, plan.kernel, scale, out)
    if plan.decode_rows.numel():
        _attend_decode(q, keys, values, plan, scale, out)
    bf16_kernel = plan.prefill_kernel and q.dtype == torch.bfloat16 and q.shape[-1] in PREFILL_KERNEL_HEAD_DIMS
    for start, n, slots, mask, causal in plan.prefill:
        if bf16_kernel and causal:
            _attend_chunk_kernel(q, keys, values, start, n, slots, scale, out, plan.prefill_amx)
        else:
            _attend_chunk(q, keys, values, start, n, slots, mask, scale, out)
    return out


def _attend_eager(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, n: int,
                  slots: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None,
                  sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    nh, kvh = q.shape[1], keys.shape[1]
    k = keys.index_select(0, slots).transpose(0, 1).repeat_interleave(nh // kvh, dim=0)  # [nh, L, hd]
    v = values.index_select(0, slots).transpose(0, 1).repeat_interleave(nh // kvh, dim=0)
    scores = torch.matmul(q[start : start + n].transpose(0, 1).float(), k.float().transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # the sink takes its share of the softmax and contributes no value
        scores = torch.cat([scores, sinks.view(nh, 1, 1).expand(nh, n, 1)], dim=-1)
        probs = scores.softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out[start : start + n] = torch.matmul(probs.to(v.dtype), v).transpose(0, 1)


def _attend_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, args: _KernelArgs, scale: float,
                   out: torch.Tensor) -> None:
    ops = cpu_extension.kernels()
    if args.contiguous:  # the common case: the kernel writes its rows of `out` in place
        first, n = int(args.rows[0]), args.rows.numel()
        ops.paged_attention(q[first : first + n], keys, values, out[first : first + n], args.slots, args.seqs,
                            args.masks, args.mask_at, scale)
        return
    qk = q.index_select(0, args.rows)
    ok = torch.empty_like(qk)
    ops.paged_attention(qk, keys, values, ok, args.slots, args.seqs, args.masks, args.mask_at, scale)
    out[args.rows] = ok


def _attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan, scale: float,
                   out: torch.Tensor) -> None:
    nh, kvh, hd = q.shape[1], keys.shape[1], q.shape[2]
    b = plan.decode_rows.numel()
    # Query heads grouped by the KV head they share: [B, kvh, group, hd].
    qd = q[plan.decode_rows].view(b, kvh, nh // kvh, hd)
    # index_select on the flat slot list is several times faster than advanced indexing.
    flat = plan.decode_slots.view(-1)
    kd = keys.index_select(0, flat).view(b, -1, kvh, hd).transpose(1, 2)
    vd = values.index_select(0, flat).view(b, -1, kvh, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale)
    out[plan.decode_rows] = o.reshape(b, nh, hd)


def _attend_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, n: int,
                  slots: torch.Tensor, mask: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    nh, kvh = q.shape[1], keys.shape[1]
    qp = q[start : start + n].transpose(0, 1)[None]
    kp = keys.index_select(0, slots).transpose(0, 1)[None]
    vp = values.index_select(0, slots).transpose(0, 1)[None]
    if mask is not None and qp.is_cuda and nh != kvh:
        o = grouped_query_attention(qp, kp, vp, mask, scale)
    else:
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, enable_gqa=True,
                                           scale=scale)
    out[start : start + n] = o[0].transpose(0, 1)


def _attend_chunk_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, n: int,
                         slots: torch.Tensor, scale: float, out: torch.Tensor, amx: bool) -> None:
    """A bfloat16 chunk over its causal context (cpu/prefill_attention.cpp); `q` and `out` are
    contiguous `[T, nh, hd]`, so their rows of the chunk are too."""
    cpu_extension.kernels().bf16_prefill_attention(q[start : start + n], keys.index_select(0, slots),
                                                   values.index_select(0, slots), out[start : start + n],
                                                   scale, amx)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
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
    o = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask.repeat(nh // kvh, 1), scale=scale)
    return o.view(1, nh, n, hd)
