"""The CPU paged-attention kernel (cpu/paged_attention.cpp) against the torch fallback and
against dense attention computed independently here: decode and short chunks, grouped-query heads,
sliding-window masks with sinks, slots scattered over the pool, kernel and SDPA slices interleaved,
contexts the kernel splits into parts (a window's middle parts attend nothing), and a row's bits
independent of the rows computed beside it."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from common.engine.attention_window import AttentionWindow
from common.model.paged_attention import KERNEL_MAX_QUERIES, AttentionPlan, SequenceSlice, attend, kernel_enabled
from cpu import extension

NH, KVH, HD, SLOTS = 6, 2, 16, 2048
KEY_PART = 256  # cpu/paged_attention.cpp kKeyPart: longer contexts are attended in parts, then merged
CPU = torch.device("cpu")

needs_kernel = pytest.mark.skipif(not kernel_enabled(CPU, torch.float32),
                                  reason=f"CPU kernel unavailable: {extension.unavailable_reason()}")


def test_the_kernels_build_wherever_a_compiler_is_on_path() -> None:
    """A compile error on one kind of CPU (a name declared only for AVX512-BF16, say) fails here
    instead of turning every kernel test into a skip and every daemon start into a failed build."""
    if os.environ.get(extension.DISABLE_ENV, "") not in ("", "0"):
        pytest.skip(f"{extension.DISABLE_ENV} is set")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler on PATH")
    assert extension.kernels() is not None, extension.unavailable_reason()


def _slices(gen: torch.Generator, shapes: list[tuple[int, int]], window: AttentionWindow | None) -> list[SequenceSlice]:
    """Sequences of (new tokens, context length) on disjoint random slots."""
    perm = torch.randperm(SLOTS, generator=gen)
    out, used = [], 0
    for n, length in shapes:
        slots = perm[used : used + length]
        used += length
        mask = None
        if window is not None:
            positions = torch.arange(length)
            mask = window.mask(positions[length - n :], positions)
        out.append(SequenceSlice(n, slots, mask))
    return out


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slices: list[SequenceSlice]) -> torch.Tensor:
    """Each sequence on its own: its K/V copied out, heads repeated, softmax over masked scores."""
    rows, start = [], 0
    for s in slices:
        qs = q[start : start + s.num_new].transpose(0, 1)  # [nh, n, hd]
        start += s.num_new
        group = q.shape[1] // keys.shape[1]
        k = keys[s.context_slots].repeat_interleave(group, dim=1).transpose(0, 1)
        v = values[s.context_slots].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = s.mask
        if mask is None:
            q_pos = torch.arange(s.context_len - s.num_new, s.context_len)
            mask = torch.arange(s.context_len)[None, :] <= q_pos[:, None]
        scores = (qs @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        rows.append((F.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return torch.cat(rows)


@needs_kernel
@pytest.mark.parametrize("window", [None, AttentionWindow(5, sinks=2)], ids=["causal", "window+sinks"])
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, HD), (torch.float32, 64), (torch.bfloat16, 64)],
                         ids=["fp32-generic", "fp32-hd64", "bf16-hd64"])
def test_kernel_equals_fallback_and_dense(window: AttentionWindow | None, dtype: torch.dtype, head_dim: int) -> None:
    """Head dims 64 and 128 take the kernel's compile-time-unrolled path, others the generic one;
    bfloat16 is compared with dense float32 attention over the same (rounded) values, within
    the rounding of a bfloat16 output."""
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(SLOTS, KVH, head_dim, generator=gen).to(dtype) for _ in range(2))
    # decodes, a prefill chunk the kernel does not take between them, a whole-prompt chunk
    shapes = [(1, 37), (KERNEL_MAX_QUERIES + 3, 50), (1, 1), (KERNEL_MAX_QUERIES, 20), (1, 90), (7, 7),
              (1, 3 * KEY_PART + 5), (KERNEL_MAX_QUERIES, 2 * KEY_PART + 1), (1, KEY_PART), (1, KEY_PART + 1)]
    slices = _slices(gen, shapes, window)
    q = torch.randn(sum(n for n, _ in shapes), NH, head_dim, generator=gen).to(dtype)
    with_kernel = AttentionPlan(slices, CPU, use_kernel=True)
    assert with_kernel.kernel is not None and not with_kernel.kernel.contiguous
    got = attend(q, keys, values, with_kernel)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16 keeps 8 bits of mantissa
    dense = _dense(q.float(), keys.float(), values.float(), slices)
    torch.testing.assert_close(got.float(), dense, rtol=tol, atol=tol)
    fallback = attend(q, keys, values, AttentionPlan(slices, CPU, use_kernel=False))
    torch.testing.assert_close(got.float(), fallback.float(), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each sequence's rows attended alone and in a batch with others (long contexts split into
    parts among them) are the same bits: a request's tokens never depend on what runs beside it."""
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(SLOTS, KVH, 64, generator=gen).to(dtype) for _ in range(2))
    shapes = [(1, 700), (1, 3), (KERNEL_MAX_QUERIES, 300), (1, KEY_PART + 17)]
    slices = _slices(gen, shapes, None)
    q = torch.randn(sum(n for n, _ in shapes), NH, 64, generator=gen).to(dtype)
    together = attend(q, keys, values, AttentionPlan(slices, CPU, use_kernel=True))
    start = 0
    for s in slices:
        alone = attend(q[start : start + s.num_new], keys, values, AttentionPlan([s], CPU, use_kernel=True))
        assert torch.equal(alone, together[start : start + s.num_new])
        start += s.num_new


@needs_kernel
def test_kernel_refuses_out_of_range_slots() -> None:
    q = torch.randn(1, NH, HD)
    plan = AttentionPlan([SequenceSlice(1, torch.tensor([0, SLOTS]))], CPU, use_kernel=True)
    with pytest.raises(RuntimeError, match="slot out of range"):
        attend(q, torch.zeros(SLOTS, KVH, HD), torch.zeros(SLOTS, KVH, HD), plan)


def test_disabled_kernel_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """DUET_DISABLE_CPU_KERNELS: no build, a reason, and the torch path."""
    monkeypatch.setenv(extension.DISABLE_ENV, "1")
    assert extension._load() == {"reason": f"{extension.DISABLE_ENV} is set"}
