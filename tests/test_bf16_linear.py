"""The bf16 linear kernel (cpu/bf16_linear.cpp) against float32 products of the same bf16 values."""
from __future__ import annotations

import pytest
import torch

from common.model.packed_linear import Linear
from common.serving.dtype_choice import cpu_flags
from cpu import extension as cpu_extension

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the kernel needs AVX512-BF16")


def test_the_kernel_builds_and_takes_bf16_layers_here():
    assert cpu_extension.kernels() is not None, cpu_extension.unavailable_reason()
    assert Linear(torch.zeros(64, 8, dtype=torch.bfloat16)).kernel is not None
    assert Linear(torch.zeros(64, 8)).kernel is None  # float32 stays on oneDNN
    assert Linear(torch.zeros(40, 8, dtype=torch.bfloat16)).kernel is None  # not a multiple of 64 columns


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_float32_within_one_bf16_rounding(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(192, 576, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(192, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    got = Linear(weight, bias)(x)
    want = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    # float32 sums in another order, then one rounding to bf16 (8 bits of mantissa)
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-3)
