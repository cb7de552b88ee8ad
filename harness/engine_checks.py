"""Checks of the in-process engine: a request's stream read to its end, the pool whole again,
logits at every position (one prefill, or teacher-forced step by step as a decode node computes
them), and the spacing of bfloat16 numbers that bounds what bf16 can tell apart."""
from __future__ import annotations

import torch

from common.engine.core import Engine
from common.engine.generation import Chunk, RequestHandle
from common.engine.scheduler import Scheduler
from common.model.decoder import DecoderModel, ForwardBatch, SequenceSlice


def collect(handle: RequestHandle) -> tuple[list[int], str, Chunk]:
    """A one-sample request's tokens, text and final chunk."""
    tokens, text = [], ""
    while True:
        chunk = handle.next_chunk(timeout=120)
        assert chunk is not None, "scheduler stalled"
        tokens += chunk.token_ids
        text += chunk.text
        if chunk.finish_reason:
            return tokens, text, chunk


def collect_samples(handle: RequestHandle) -> tuple[dict[int, list[int]], dict[int, str], Chunk]:
    """Tokens and finish reason of each parallel sample, and the stream's final chunk."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while True:
        chunk = handle.next_chunk(timeout=120)
        assert chunk is not None, "scheduler stalled"
        assert chunk.index not in reasons, f"a chunk of sample {chunk.index} after it finished"
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
        if chunk.final:
            return tokens, reasons, chunk


def assert_pool_whole(s: Scheduler) -> None:
    """Every page free once the prefix cache lets go of its own: nothing leaked."""
    engine = s.engine
    with engine.lock:
        engine.prefix_cache.clear()
        assert engine.allocator.num_free == engine.allocator.num_pages


def full_logits(model: DecoderModel, ids: list[int], scatter: bool = True, long_rope: bool = False) -> torch.Tensor:
    """Logits at every position from one prefill whose K/V land on scattered slots (`long_rope`:
    with longrope's long factors)."""
    n = len(ids)
    pool = model.new_pool(num_pages=-(-n // 16) * 2, page_size=16)
    slots = torch.randperm(pool.num_slots)[:n] if scatter else torch.arange(n)
    rows = torch.arange(n) + (model.long_rope_offset if long_rope else 0)
    batch = ForwardBatch(torch.tensor(ids), rows, [SequenceSlice(n, slots)], torch.arange(n))
    return model.forward(batch, pool)


def teacher_forced(model: DecoderModel, ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Our logits at the prompt's last position and after each forced continuation token, the
    way a decode node computes them: one prefill, then one-token steps."""
    engine = Engine(model, num_pages=-(-(len(ids) + len(continuation)) // 16) + 1, page_size=16)
    seq = engine.new_sequence("tf", ids, use_prefix_cache=False)
    engine.reserve(seq, len(ids))
    rows = [engine.forward([(seq, len(ids))])[0]]
    for token in continuation[:-1]:
        seq.token_ids.append(token)
        engine.reserve(seq, len(seq.token_ids))
        rows.append(engine.forward([(seq, 1)])[0])
    return torch.stack(rows)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at `x` (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
