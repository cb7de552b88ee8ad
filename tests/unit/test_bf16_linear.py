"""The bf16 linear kernel (cpu/bf16_linear.cpp), each of its instruction paths, against float32
products of the same bf16 values, and its rows against their batch."""
from __future__ import annotations

import pytest
import torch

from common.model.packed_linear import Linear
from common.serving.dtype_choice import cpu_flags
from cpu import extension as cpu_extension

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the kernel needs AVX512-BF16")


def _paths() -> list[bool]:
    """`amx` values to try here: the AVX512-BF16 path always, the AMX one where this process may use it."""
    ops = cpu_extension.kernels()
    amx = ops is not None and cpu_extension.has_bf16_linear(ops) and ops.bf16_linear_amx_available()
    return [False, True] if amx else [False]


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, amx: bool) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    cpu_extension.kernels().bf16_linear(x, cpu_extension.pack_bf16_linear(weight),
                                        torch.empty(0) if bias is None else bias.float(), out, amx)
    return out


def test_the_kernel_builds_and_takes_bf16_layers_here():
    assert cpu_extension.kernels() is not None, cpu_extension.unavailable_reason()
    amx = cpu_extension.kernels().bf16_linear_amx_available()
    assert amx == ("amx_bf16" in cpu_flags())  # Linux grants the tiles wherever the CPU has them
    assert Linear(torch.zeros(64, 64, dtype=torch.bfloat16)).instructions == ("amx" if amx else "avx512_bf16")
    assert Linear(torch.zeros(64, 8, dtype=torch.bfloat16)).instructions == "avx512_bf16"  # k not a tile row
    assert Linear(torch.zeros(64, 8)).instructions == "onednn"  # float32 stays on oneDNN
    assert Linear(torch.zeros(40, 8, dtype=torch.bfloat16)).instructions == "onednn"  # not 64 columns


@pytest.mark.parametrize("amx", _paths())
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_float32_within_one_bf16_rounding(amx, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(192, 576, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(192, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    got = _product(x, weight, bias, amx)
    want = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    # float32 sums in another order, then one rounding to bf16 (8 bits of mantissa)
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("amx", _paths())
def test_a_row_never_depends_on_its_batch(amx):
    """A prompt's last token is computed inside a chunk on one node and alone on another: every
    row of a 37-row product (two full AMX blocks and a 5-row tail) equals the row computed alone,
    and any slice of the batch equals those rows, whatever the thread count."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(1536, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(37, 576, generator=gen).bfloat16()
    whole = _product(x, weight, None, amx)
    for r in range(37):
        assert torch.equal(_product(x[r : r + 1].contiguous(), weight, None, amx), whole[r : r + 1]), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for begin, end in ((0, 16), (3, 20), (16, 37), (30, 37)):
            assert torch.equal(_product(x[begin:end].contiguous(), weight, None, amx), whole[begin:end])
    finally:
        torch.set_num_threads(threads)
