"""Where a sequence's positions live in a pool: page tables to slots, and runs of slots.

`slots_at` is the one mapping from positions to slots. A slot is `page * page_size + offset`;
an entry of a page table whose page went back to the allocator (a sliding window dropped it)
holds `RELEASED` and is never read.

`Segments` is a run-length list of slots in position order, as PrepareReceive's compressed
page-segment metadata (`kv_append_metadata`) carries it: the flat int64 list
`[n, start_0, len_0, start_1, len_1, ...]`, each segment a maximal run of consecutive slots.
Page size 4, 6 tokens reserved on pages 7 and 2 starting at offset 1 of page 7 gives
`[2, 29, 3, 8, 3]` (slots 29, 30, 31 then 8, 9, 10). Metadata is decoded once, where it arrives
(`Segments.from_wire`, which checks it against the pool and the expected length), and from then
on the allocator's side, the receiver and the sender all use the same value.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

RELEASED = -1  # a page-table entry whose page went back to the allocator


def slots_at(pages: Sequence[int], page_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Slot indices of `positions` of a sequence whose page table is `pages`. Refuses a
    position past the table or on a released entry, which would read another sequence's K/V."""
    if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < len(pages) * page_size:
        raise ValueError(f"positions up to {int(positions.max())} are outside the {len(pages)}-page table "
                         f"({len(pages) * page_size} positions)")
    table = torch.tensor(list(pages), dtype=torch.long)[positions // page_size]
    if bool((table == RELEASED).any()):
        raise RuntimeError("a position lies on a released KV page: the window bookkeeping is wrong")
    return table * page_size + positions % page_size


def slot_range(pages: Sequence[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions `[start, end)` (`slots_at` over a range)."""
    if not 0 <= start <= end <= len(pages) * page_size:
        raise ValueError(f"positions [{start}, {end}) are outside the {len(pages)}-page table "
                         f"({len(pages) * page_size} positions)")
    return slots_at(pages, page_size, torch.arange(start, end))


class MetadataError(ValueError):
    """`kv_append_metadata` is malformed or does not fit the request or the pool."""


@dataclass(frozen=True)
class Segments:
    """Runs of consecutive slots, `(start, length)`, in position order."""

    runs: tuple[tuple[int, int], ...]

    @classmethod
    def of_slots(cls, slots: Sequence[int] | np.ndarray | torch.Tensor) -> Segments:
        """Maximal runs of `slots` (in position order)."""
        a = np.asarray(slots, dtype=np.int64).reshape(-1)
        if a.size == 0:
            return cls(())
        firsts = np.concatenate([[0], np.flatnonzero(np.diff(a) != 1) + 1])
        lengths = np.diff(np.concatenate([firsts, [a.size]]))
        return cls(tuple(zip(a[firsts].tolist(), lengths.tolist())))

    @classmethod
    def from_wire(cls, metadata: Sequence[int] | np.ndarray, expected_tokens: int, num_slots: int) -> Segments:
        """Untrusted metadata, checked against the request and the destination pool. Raises
        `MetadataError` naming the first problem: shape, a bad segment, slots outside
        `[0, num_slots)`, a token count other than `expected_tokens`, or overlapping segments."""
        if len(metadata) == 0:
            raise MetadataError("kv_append_metadata is empty; expected [n, start_0, len_0, ...]")
        n = int(metadata[0])
        if n < 0:
            raise MetadataError(f"kv_append_metadata declares n={n} segments; n must be >= 0")
        if len(metadata) != 2 * n + 1:
            raise MetadataError(f"kv_append_metadata has {len(metadata)} entries but n={n} segments need "
                                f"2n+1 = {2 * n + 1}")
        runs = tuple((int(metadata[1 + 2 * i]), int(metadata[2 + 2 * i])) for i in range(n))
        for i, (start, length) in enumerate(runs):
            if length <= 0:
                raise MetadataError(f"segment {i} (start={start}, len={length}): len must be positive")
            if start < 0:
                raise MetadataError(f"segment {i} (start={start}, len={length}): start must be >= 0")
            if start + length > num_slots:
                raise MetadataError(f"segment {i} covers slots [{start}, {start + length}) but the pool has "
                                    f"{num_slots} slots")
        total = sum(length for _, length in runs)
        if total != expected_tokens:
            raise MetadataError(f"segments cover {total} tokens but {expected_tokens} are expected")
        by_start = sorted(range(n), key=lambda i: runs[i][0])
        for prev, cur in zip(by_start, by_start[1:]):
            (p_start, p_len), (c_start, c_len) = runs[prev], runs[cur]
            if p_start + p_len > c_start:
                raise MetadataError(f"segment {cur} slots [{c_start}, {c_start + c_len}) overlap segment {prev} "
                                    f"slots [{p_start}, {p_start + p_len})")
        return cls(runs)

    def to_wire(self) -> list[int]:
        return [len(self.runs)] + [x for run in self.runs for x in run]

    @property
    def num_slots(self) -> int:
        return sum(n for _, n in self.runs)

    def __len__(self) -> int:
        return len(self.runs)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.runs)

    def slots(self) -> np.ndarray:
        """Every slot, in position order."""
        if not self.runs:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in self.runs])

    def window(self, start: int, stop: int) -> Segments:
        """The runs of the slots at indices `[start, stop)` (positions relative to the first)."""
        out, at = [], 0
        for s, n in self.runs:
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                out.append((s + lo - at, hi - lo))
            at += n
            if at >= stop:
                break
        return Segments(tuple(out))


MULTI_GROUP = -2  # kv_append_metadata's first entry in the two-group form


@dataclass(frozen=True)
class Placement:
    """Where a receiver holds a transfer's window `[begin, end)`: `full`, the slots of every
    position (all layers of a pool with one group, its full-attention layers otherwise), and for a
    pool whose sliding layers have a group of their own (common/kv/pool.py), `sliding`: that
    group's slots of the window's last `sliding.num_slots` positions, all a sliding layer is sent.

    On the wire (`kv_append_metadata`) a placement without `sliding` is the single-group form
    `[n, start_0, len_0, ...]`; with it, the two-group form `[-2, n, start_0, len_0, ..., m,
    start_0, len_0, ...]`: the full group's n segments, then the sliding group's m."""

    full: Segments
    sliding: Segments | None = None

    def to_wire(self) -> list[int]:
        if self.sliding is None:
            return self.full.to_wire()
        return [MULTI_GROUP, *self.full.to_wire(), *self.sliding.to_wire()]

    @classmethod
    def from_wire(cls, metadata: Sequence[int] | np.ndarray, expected_tokens: int, num_slots: int,
                  sliding_tokens: int | None = None, sliding_slots: int = 0) -> Placement:
        """Untrusted metadata, checked as `Segments.from_wire` checks each group: the full group
        against `expected_tokens` and `num_slots`, a sliding group against `sliding_tokens` (the
        window's positions a sliding layer is sent; None: the reader's model has no sliding
        layers, and refuses the two-group form) and `sliding_slots`. Raises `MetadataError`, or
        `MultiGroupUnreadable` for a two-group form it cannot read."""
        if len(metadata) == 0 or int(metadata[0]) != MULTI_GROUP:
            return cls(Segments.from_wire(metadata, expected_tokens, num_slots))
        if sliding_tokens is None:
            raise MultiGroupUnreadable(
                "kv_append_metadata is in the two-group form [-2, n, runs..., m, runs...] of a decode node that "
                "keeps a hybrid model's sliding layers on pages of their own; this node's model has no sliding "
                "layers, so the two nodes do not serve the same model")
        if len(metadata) < 2:
            raise MetadataError("kv_append_metadata [-2] names no groups; expected [-2, n, runs..., m, runs...]")
        split = 2 + 2 * max(int(metadata[1]), 0)
        groups = []
        for name, part, tokens, slots in (("full", metadata[1:split], expected_tokens, num_slots),
                                          ("sliding", metadata[split:], sliding_tokens, sliding_slots)):
            try:
                groups.append(Segments.from_wire(part, tokens, slots))
            except MetadataError as exc:
                raise MetadataError(f"the {name} group of the two-group form: {exc}") from None
        return cls(*groups)


class MultiGroupUnreadable(MetadataError):
    """Two-group metadata at a node whose model has one group (FAILED_PRECONDITION)."""
