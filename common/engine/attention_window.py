"""Sliding-window attention with attention sinks: which positions a query attends, and which KV
pages a sequence may give back.

Semantics, those of transformers' Mistral/Qwen2 `sliding_window` (`kv_idx > q_idx - window`):
a query at position `i` attends key positions `j` with `i - window < j <= i`, i.e. itself and the
`window - 1` positions before it. Attention sinks (StreamingLLM) add the sequence's first `sinks`
positions: a query at `i` also attends every `j < sinks` with `j <= i`. Every position keeps its
own RoPE angle (the cache is not re-indexed as StreamingLLM's rolling cache is), so the model's
output is exactly that of a dense attention under this mask.

A sequence's page table keeps one entry per page index, so position `p` stays on entry
`p // page_size`; an entry whose page was given back holds `RELEASED` and is never read, because
every position a future query attends lies on a held page.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from common.kv.segments import RELEASED
from common.model.checkpoint import Checkpoint
from common.model.config import ModelConfig
from common.model.paged_attention import window_keys, window_mask


@dataclass(frozen=True)
class AttentionWindow:
    """Validated by ModelConfig, which it is made from."""

    size: int  # keys within `size` positions of the query, the query's own included
    sinks: int = 0  # leading positions every query attends

    @classmethod
    def of(cls, config: ModelConfig) -> AttentionWindow | None:
        """The model's window, or None for full attention."""
        return None if config.sliding_window is None else cls(config.sliding_window, config.attention_sinks)

    def first_needed(self, query: int) -> int:
        """The first non-sink position that a query at `query` or later attends."""
        return max(0, query - self.size + 1)

    def context_positions(self, first_query: int, end: int) -> torch.Tensor:
        """Ascending key positions that queries at `[first_query, end)` attend: the sinks, then
        `[first_needed(first_query), end)`."""
        return window_keys(first_query, end, self.size, self.sinks)

    def mask(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """`[queries, keys]` bool: True where the query attends the key."""
        return window_mask(query_positions, key_positions, self.size, self.sinks)

    def transfer_begin(self, matched: int, end: int) -> int:
        """The first position a writer must send to a sequence that holds `matched` cached
        positions and computes on from `end` (it sends `[begin, end)`).

        Sink positions the cache does not hold would make the needed range non-contiguous;
        then everything from `matched` is sent and the surplus pages are given back after the
        first decode step."""
        if matched >= end or matched < min(self.sinks, self.first_needed(end)):
            return matched
        return max(matched, self.first_needed(end))

    def max_pages(self, page_size: int) -> int:
        """Pages a decoding sequence holds at most: those the window spans, plus the sinks'."""
        return 1 + -(-self.size // page_size) + -(-self.sinks // page_size)

    def releasable(self, pages: Sequence[int], page_size: int, before: int) -> list[int]:
        """Indices of held table entries whose positions all lie before `before` and that hold
        no sink position."""
        first = -(-self.sinks // page_size)  # the first entry without a sink
        last = before // page_size  # entries below it end at or before `before`
        return [i for i in range(first, min(last, len(pages))) if pages[i] != RELEASED]


def layer_skips(config: ModelConfig, begin: int, end: int) -> tuple[int, ...]:
    """Per layer, how many leading positions of a transfer of `[begin, end)` it need not move to a
    node that computes on from `end`: for a sliding layer of a hybrid model (Gemma 2/3, gpt-oss)
    those before `end - window + 1`, which no query from `end` on attends; 0 for every other layer
    (a model whose every layer slides skips them all at once: `AttentionWindow.transfer_begin`).
    A receiver that got a transfer with skips holds only partial KV before `begin + max(skips)`."""
    if config.layer_windows is None:
        return (0,) * config.num_layers
    return tuple(0 if w is None else min(end - begin, max(0, end - w + 1 - begin)) for w in config.layer_windows)


def with_attention_sinks(ckpt: Checkpoint, sinks: int) -> Checkpoint:
    """The checkpoint with `sinks` attention sinks (the daemons' --attention-sinks). The K/V of
    every layer but the first depends on them, so they join the model hash that the
    compatibility fingerprint compares: a prefill and a decode node must use the same count."""
    if sinks == 0:
        return ckpt
    try:
        config = replace(ckpt.config, attention_sinks=sinks)
    except ValueError as exc:
        raise ValueError(f"--attention-sinks {sinks}: {exc}") from None
    return replace(ckpt, config=config, model_hash=f"{ckpt.model_hash};attention_sinks={sinks}")
