"""Runs model forwards for sequences whose K/V live in the paged pool.

The engine owns the pool, its page allocator and the prefix cache; a `Sequence` owns one
reference on each page of its page table. Pages are only allocated here, on demand, as a
sequence's computed length grows.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.kv_pool import KVPool
from common.model import ForwardBatch, LlamaModel, SequenceSlice
from common.page_allocator import PageAllocator
from common.prefix_cache import PrefixCache


@dataclass
class Sequence:
    seq_id: str
    token_ids: list[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading positions whose K/V are in the pool
    num_cached: int = 0  # of those, how many came from the prefix cache

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class Engine:
    def __init__(self, model: LlamaModel, num_pages: int, page_size: int) -> None:
        self.model = model
        self.pool: KVPool = model.new_pool(num_pages, page_size)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(self.allocator, page_size)
        # Guards page tables, the allocator and the prefix cache for every thread that
        # allocates (the scheduler loop, the decode node's PrepareReceive handlers).
        self.lock = threading.RLock()

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Pages to add so `seq` can hold `num_tokens` positions."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def new_sequence(self, seq_id: str, token_ids: list[int], use_prefix_cache: bool = True) -> Sequence:
        """A sequence starting from the longest cached prefix; at least the last token is left
        to compute so its logits exist."""
        seq = Sequence(seq_id, list(token_ids))
        if use_prefix_cache:
            self.attach_cached_prefix(seq)
        return seq

    def attach_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence that holds no pages the longest cached prefix of its tokens."""
        assert not seq.pages, "the sequence already holds pages"
        seq.pages, seq.num_computed = self.prefix_cache.match(seq.token_ids[:-1])
        seq.num_cached = max(seq.num_cached, seq.num_computed)

    def reserve(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Grow the page table to hold `num_tokens` positions, evicting cold cached prefixes
        if needed; raises OutOfPages (leaving the sequence unchanged) when the pool is full."""
        new = self.prefix_cache.allocate(self.pages_needed(seq, num_tokens))
        seq.pages.extend(new)
        return new

    def forward(
        self,
        work: list[tuple[Sequence, int]],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Compute the next `n` pending positions of each sequence; returns `[len(work), vocab]`
        logits at each one's last computed position. Pages must already be reserved."""
        ids, positions, slices, rows = [], [], [], []
        total = 0
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            if n <= 0 or end > len(seq.token_ids):
                raise ValueError(f"{seq.seq_id}: cannot compute {n} positions from {start} of {len(seq.token_ids)}")
            ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slices.append(SequenceSlice(n, self.pool.slots_for(seq.pages, 0, end)))
            total += n
            rows.append(total - 1)
        batch = ForwardBatch(
            token_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.cat(positions),
            slices=slices,
            logit_rows=torch.tensor(rows, dtype=torch.long),
        )
        logits = self.model.forward(batch, self.pool, on_layer_done)
        for seq, n in work:
            seq.num_computed += n
        return logits

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Drop the sequence's page references, first recording its computed full pages in the
        prefix cache so later requests can reuse them."""
        if cache and seq.num_computed:
            self.prefix_cache.insert(seq.token_ids[: seq.num_computed], seq.pages)
        self.allocator.decref(seq.pages)
        seq.pages = []
        seq.num_computed = 0
