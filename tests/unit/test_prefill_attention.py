"""The bfloat16 prefill attention kernel (cpu/prefill_attention.cpp): as close to float32 attention
as SDPA's bfloat16 path, bit for bit the same rows however a prompt is chunked (so a colocated
node's chunks and a prefill node's whole prompt agree), and the engine's bf16 prefill with it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.core import Engine
from common.model.decoder import DecoderModel
from common.serving.dtype_choice import cpu_flags
from cpu import extension

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the kernel needs AVX512-BF16")
SCALE_64 = 64 ** -0.5
# The kernel's instruction paths: both where this CPU has AMX (the engine takes that one), else AVX512-BF16.
PATHS = [pytest.param(False, id="avx512_bf16"),
         pytest.param(True, id="amx", marks=pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="no AMX here"))]


def _qkv(n: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    k = (2 * torch.randn(length, kv_heads, head_dim, generator=gen)).bfloat16()  # wide scores
    v = torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16()
    return q, k, v


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, amx: bool = False) -> torch.Tensor:
    out = torch.empty_like(q)
    extension.kernels().bf16_prefill_attention(q, k, v, out, q.shape[-1] ** -0.5, amx)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries at the last len(q) positions of the context, causal, in q's dtype."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def test_the_kernel_is_built_here() -> None:
    assert extension.has_bf16_prefill_attention(extension.kernels()), extension.unavailable_reason()


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "head_dim"),
                         [(300, 300, 9, 3, 64), (100, 300, 9, 3, 64), (5, 40, 9, 3, 64), (70, 70, 4, 2, 128)],
                         ids=["whole-prompt", "tail-chunk", "short-chunk", "head-dim-128"])
def test_as_close_to_float32_as_sdpa_in_bf16(n: int, length: int, heads: int, kv_heads: int, head_dim: int,
                                             amx: bool) -> None:
    q, k, v = _qkv(n, length, heads, kv_heads, head_dim)
    exact = _sdpa(q.float(), k.float(), v.float())
    ours, sdpa = (f(q, k, v).float() - exact for f in (lambda *t: _kernel(*t, amx=amx), _sdpa))
    torch.testing.assert_close(ours + exact, exact, atol=2e-2, rtol=2e-2)
    assert ours.abs().mean() <= 1.25 * sdpa.abs().mean()  # about one bf16 rounding of the output
    assert ours.abs().max() <= 2 * sdpa.abs().max()


@pytest.mark.parametrize("amx", PATHS)
def test_a_row_does_not_depend_on_how_its_prompt_was_chunked(amx: bool) -> None:
    q, k, v = _qkv(300, 300, 9, 3, 64, seed=1)
    whole = _kernel(q, k, v, amx)
    for start in (1, 15, 16, 17, 31, 32, 33, 150, 299):  # tails cut at, around and off the row and key blocks
        assert torch.equal(_kernel(q[start:].contiguous(), k, v, amx), whole[start:])
    assert torch.equal(_kernel(q[40:200].contiguous(), k[:200].contiguous(), v[:200].contiguous(), amx),
                       whole[40:200])


def test_refuses_what_it_was_not_built_for() -> None:
    q, k, v = _qkv(4, 8, 2, 1, 96)
    with pytest.raises(RuntimeError, match="head dims 64 and 128"):
        _kernel(q, k, v)
    q, k, v = _qkv(8, 4, 2, 1, 64)
    with pytest.raises(RuntimeError, match="do not agree"):
        _kernel(q, k, v)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _kernel(q.float(), k.float(), v.float())


def test_engine_prefills_the_same_bits_in_chunks_as_in_one_piece(model_bf16: DecoderModel) -> None:
    """What a prefill node computes for a whole prompt, a colocated node computes chunk by chunk:
    every layer's K/V and the last position's logits, bit for bit."""
    prompt = torch.randint(0, model_bf16.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for chunks in ([150], [40, 40, 40, 30], [64, 86]):
        engine = Engine(model_bf16, num_pages=16, page_size=16)
        seq = engine.new_sequence("p", prompt, use_prefix_cache=False)
        engine.reserve(seq, len(prompt))
        for n in chunks:
            logits = engine.forward([(seq, n)])
        slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in seq.pages])[: len(prompt)]
        results.append((logits, engine.pool.data.index_select(2, slots)))
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(kv, results[0][1])
