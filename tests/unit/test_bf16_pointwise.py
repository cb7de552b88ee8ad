"""The bf16 row-wise kernels (cpu/bf16_pointwise.cpp) against transformers' bf16 op sequences
written in torch here, bit for bit: RMSNorm (squares summed in float64) and RoPE on fused QKV
rows, over rows of ordinary, tiny, huge, denormal and non-finite values."""
from __future__ import annotations

import pytest
import torch

from cpu import extension

needs_kernels = pytest.mark.skipif(extension.kernels() is None,
                                   reason=f"CPU kernels unavailable: {extension.unavailable_reason()}")


def _rows(gen: torch.Generator, shape: tuple[int, int], scale: float) -> torch.Tensor:
    x = (torch.randn(*shape, generator=gen) * scale).bfloat16()
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, -1e-39])
    return x


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits, except that a NaN may carry either sign."""
    nan = got.isnan()
    return torch.equal(nan, want.isnan()) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@needs_kernels
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3, 1e-30])
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_rms_norm_is_transformers_bits(tokens: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x, weight, eps = _rows(gen, (tokens, 576), scale), torch.randn(576, generator=gen).bfloat16(), 1e-5
    got = torch.empty_like(x)
    torch.ops.duet_cpu.rms_norm_bf16(x, weight, eps, got)
    h = x.float()
    mean = (h * h).double().sum(-1, keepdim=True).div(h.shape[-1]).float()
    want = weight.float() * (h / torch.sqrt(mean + eps)).bfloat16().float()
    assert _same_bits(got, want.bfloat16())


@needs_kernels
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rope_is_transformers_bits(tokens: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(tokens)
    d, heads, width = 64, 12, 960  # 9 query and 3 key heads rotated, the value heads left alone
    qkv = _rows(gen, (tokens, width), scale)
    cos, sin = (torch.randn(2048, d, generator=gen).bfloat16() for _ in range(2))
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    got = qkv.clone()
    torch.ops.duet_cpu.rope_bf16_(got, positions, cos, sin, heads)
    x = qkv[:, : heads * d].view(tokens, heads, d)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    want = qkv.clone()
    want[:, : heads * d] = (x * cos[positions, None] + rotated * sin[positions, None]).reshape(tokens, -1)
    assert _same_bits(got, want)
