"""Runs model forwards for sequences whose K/V live in the paged pool.

The engine owns the pool, its page allocator and the prefix cache; a `Sequence` owns one
reference on each page of its page table. Pages are only allocated here, on demand, as a
sequence's computed length grows.

One lock, `Engine.lock`, guards the page tables, the allocator, the prefix cache and every table
of other objects that refers to their pages (the schedulers', the decode node's requests and
fences). The rule is enforced in one place, `locked`: every method that reads or changes that
state runs under it, whichever thread calls; the lock is reentrant, so a caller that needs
several calls to be atomic holds it around them. Only the forward runs without it (it touches
the pool's bytes and the sequences it was given, nothing shared). `Engine.room_made` is a
condition of that lock, notified whenever pages go back to the free list or become evictable
in the prefix cache: admission waits on it.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from common.engine.attention_window import AttentionWindow, layer_skips
from common.kv.events import KvEventLog
from common.kv.page_allocator import OutOfPages, PageAllocator
from common.kv.pool import KVPool
from common.kv.prefix_cache import PrefixCache
from common.kv.segments import RELEASED, Placement, Segments, slot_range, slots_at
from common.kv.sliding_pages import SlidingPages
from common.model.decoder import ForwardBatch, DecoderModel, SequenceSlice

F = TypeVar("F", bound=Callable[..., Any])
LONG_ROPE_SALT = 1  # the prefix cache's tree of long-factor K/V (Engine.cache_salt)


def locked(method: F) -> F:
    """Run `method` holding `self.lock` (an engine's lock, shared by every object whose state
    refers to its pages)."""
    @functools.wraps(method)
    def run_locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return run_locked  # type: ignore[return-value]


@dataclass
class Sequence:
    seq_id: str
    token_ids: list[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading positions whose K/V are in the pool
    num_cached: int = 0  # of those, how many came from the prefix cache
    # Positions before this hold K/V in some layers only: a hybrid model's sliding layers were
    # sent only their window (attention_window.layer_skips); the prefix cache records such pages
    # as partial, and serves them only to queries whose window does not reach them.
    partial_kv_before: int = 0
    # Longrope: its K/V computed with the long factors (Engine.long_rope), cached in their own tree.
    long_rope: bool = False
    # A pool with a sliding group: the sequence holds the sliding partners of the pages of table
    # entries [sliding_from, sliding_to) (common/kv/sliding_pages.py); those before are past its
    # window, those after hold no position it computed or is about to.
    sliding_from: int = 0
    sliding_to: int = 0

    @property
    def held_pages(self) -> list[int]:
        """The pages this sequence references: its table less the entries a sliding window
        released (common/engine/attention_window.py)."""
        return [p for p in self.pages if p != RELEASED]

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class Engine:
    def __init__(self, model: DecoderModel, num_pages: int, page_size: int, sliding_pages: int | None = None) -> None:
        """`sliding_pages`: for a hybrid model, the pages of its sliding layers' group (None: as
        many as `num_pages`; 0: no group of their own, every layer on the same pages)."""
        self.model = model
        windows = [w for w in model.config.layer_windows or () if w is not None]  # a hybrid model's
        self.sliding_window = max(windows, default=None)
        sliding_pages = 0 if self.sliding_window is None else num_pages if sliding_pages is None else sliding_pages
        if 0 < sliding_pages < (window_pages := -(-self.sliding_window // page_size) + 1):
            raise ValueError(f"--kv-sliding-pages {sliding_pages} cannot hold one request's sliding window of "
                             f"{self.sliding_window} positions: give it {window_pages} pages at least, or 0")
        self.pool: KVPool = model.new_pool(num_pages, page_size, sliding_pages)
        self.lock = threading.RLock()
        self.room_made = threading.Condition(self.lock)
        self.allocator = PageAllocator(num_pages, on_free=self._pages_freed)
        # The sliding group's pages, partnered with full pages (None: no sliding group).
        self.sliding = (SlidingPages(num_pages, sliding_pages, page_size, self.room_made.notify_all)
                        if sliding_pages else None)
        self.window = AttentionWindow.of(model.config)  # None: full attention, no page is released
        self.kv_events = KvEventLog(page_size)  # what WatchKvEvents streams
        self.prefix_cache = PrefixCache(self.allocator, page_size, self.kv_events, self.sliding_window, self.sliding,
                                        self.lock)
        # Longrope: sequences longer than this compute with the long factors (None: no longrope).
        self.long_rope_from = model.config.long_rope_from

    def _pages_freed(self, pages: list[int]) -> None:
        if self.sliding is not None:
            self.sliding.forget(pages)
        self.room_made.notify_all()

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Pages to add so `seq` can hold `num_tokens` positions."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def long_rope(self, length: int) -> bool:
        """Whether a sequence of `length` tokens computes every position with longrope's long
        factors (Phi-3 128k, Phi-3.5), as transformers does once a sequence outgrows the original
        context. The prefix cache keeps such K/V in a tree of its own (`cache_salt`): the same
        tokens' short-factor pages are other K/V."""
        return self.long_rope_from is not None and length > self.long_rope_from

    @staticmethod
    def cache_salt(long_rope: bool) -> int:
        """The prefix cache tree (common/kv/radix_trie.py, "Salted trees") of K/V computed with
        longrope's long factors (1) or short ones, as every other model's (0)."""
        return LONG_ROPE_SALT if long_rope else 0

    @locked
    def new_sequence(self, seq_id: str, token_ids: list[int], use_prefix_cache: bool = True,
                     length: int | None = None) -> Sequence:
        """A sequence starting from the longest cached prefix; at least the last token is left
        to compute so its logits exist. `length`: the tokens the whole prompt has, where
        `token_ids` is only its head (a prefill node's window), for the rope that length takes."""
        seq = Sequence(seq_id, list(token_ids), long_rope=self.long_rope(length or len(token_ids)))
        if use_prefix_cache:
            self.attach_cached_prefix(seq)
        return seq

    @locked
    def cached_length(self, token_ids: list[int], length: int | None = None) -> int:
        """How many leading tokens of `token_ids` the prefix cache would give a new sequence of
        them (`length` as for new_sequence)."""
        return self.prefix_cache.matched_length(token_ids, self.cache_salt(self.long_rope(length or len(token_ids))))

    @locked
    def attach_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence that holds no pages the longest cached prefix of its tokens."""
        assert not seq.pages, "the sequence already holds pages"
        salt = self.cache_salt(seq.long_rope)
        seq.partial_kv_before = self.prefix_cache.partial_before(seq.token_ids[:-1], salt)
        seq.pages, seq.num_computed = self.prefix_cache.match(seq.token_ids[:-1], salt)
        seq.num_cached = max(seq.num_cached, seq.num_computed)
        if self.sliding is not None:  # the cache's match rule left every page of the window whole
            seq.sliding_from = self._first_needed(seq.num_computed) // self.page_size
            seq.sliding_to = len(seq.pages)
            tail = seq.num_computed % self.page_size > 0  # a handed-over tail: its partner came with it
            self.sliding.hold(seq.pages[seq.sliding_from : len(seq.pages) - tail], make=False)

    @locked
    def reserve(self, seq: Sequence, num_tokens: int, window: bool = True) -> list[int]:
        """Grow the page table to hold `num_tokens` positions, evicting cold cached prefixes
        if needed; raises OutOfPages (leaving the sequence unchanged) when the pool is full. With
        `window`, also `hold_window(seq, num_tokens)` (else the caller does, before computing)."""
        last = seq.pages[-1] if seq.pages and seq.pages[-1] != RELEASED else None
        new = self.prefix_cache.allocate_contiguous(self.pages_needed(seq, num_tokens), after=last)
        seq.pages.extend(new)
        if window:
            try:
                self.hold_window(seq, num_tokens)
            except OutOfPages:
                del seq.pages[len(seq.pages) - len(new):]
                self.allocator.decref(new)
                raise
        return new

    @locked
    def hold_window(self, seq: Sequence, end: int) -> None:
        """Hold the sliding partners of `seq`'s pages up to the one holding position `end - 1`,
        made where missing, for a forward or a transfer to write (a hybrid model's sliding
        group; nothing otherwise). Raises OutOfPages, holding nothing more, when the sliding
        group has too few pages (`_hold_sliding`)."""
        if self.sliding is None:
            return
        first, to = max(seq.sliding_from, seq.sliding_to), -(-end // self.page_size)
        if to > first:
            self._hold_sliding([p for p in seq.pages[first:to] if p != RELEASED])
            seq.sliding_to = to

    def _hold_sliding(self, pages: list[int]) -> None:
        """`SlidingPages.hold` of `pages`, partners made where missing, room made first where too
        few sliding pages are free: parked K/V goes, then the sliding K/V of cold cached pages.
        Raises OutOfPages, holding nothing, when that is not enough."""
        if (short := self.sliding.missing(pages) - self.sliding.allocator.num_free) > 0:
            self.sliding.unpark(short)
        if (short := self.sliding.missing(pages) - self.sliding.allocator.num_free) > 0:
            self.prefix_cache.evict_for_sliding(short)
        self.sliding.hold(pages)

    def _first_needed(self, query: int) -> int:
        """The first position a hybrid model's sliding layers read for a query at `query` or later."""
        return max(0, query - self.sliding_window + 1)

    @locked
    def hold_window_of(self, pages: list[int], end: int) -> list[int]:
        """For pages matched from the prefix cache outside a sequence (a holder answering
        SendPrefix): hold the sliding K/V of those a query at `end` reads, so it stays while they
        are read; returns what `drop_window_of` gives back."""
        if self.sliding is None:
            return []
        held = pages[self._first_needed(end) // self.page_size :]
        self.sliding.hold(held, make=False)
        return held

    @locked
    def drop_window_of(self, held: list[int]) -> None:
        if held:
            self.sliding.drop(held)

    @locked
    def advance_window(self, seq: Sequence, first_kept: int) -> None:
        """Park the sliding partners of `seq`'s pages that lie wholly before position `first_kept`
        (a hybrid model's sliding group; nothing otherwise): their K/V stays until the group
        needs the pages (common/kv/sliding_pages.py)."""
        if self.sliding is None:
            return
        first = first_kept // self.page_size
        if first > seq.sliding_from:
            self.sliding.park(p for p in seq.pages[seq.sliding_from : min(first, seq.sliding_to)] if p != RELEASED)
            seq.sliding_from, seq.sliding_to = first, max(first, seq.sliding_to)

    @locked
    def truncate(self, seq: Sequence) -> None:
        """Give back the pages past those holding `seq`'s computed positions (reserved for
        speculative draft positions that were rejected). They are private to `seq`: pages a
        sequence shares (prefix cache, forks) all lie before its computed end."""
        keep = -(-seq.num_computed // self.page_size)
        if self.sliding is not None and seq.sliding_to > keep:
            first = max(keep, seq.sliding_from)
            self.sliding.drop(p for p in seq.pages[first : seq.sliding_to] if p != RELEASED)
            seq.sliding_to = first
        extra, seq.pages = seq.pages[keep:], seq.pages[:keep]
        self.allocator.decref(p for p in extra if p != RELEASED)

    @locked
    def fork(self, parent: Sequence, seq_id: str) -> Sequence:
        """A sequence that continues `parent`'s computed positions with tokens of its own (one of
        parallel samples): it shares every full page (one more reference each) and gets a private
        copy of the last partial page, so neither sequence's appends touch the other's KV. Raises
        OutOfPages, changing nothing, when no page can be had for the copy."""
        computed = parent.num_computed
        full, partial = divmod(computed, self.page_size)
        copy = self.prefix_cache.allocate(1) if partial else []
        shared = parent.pages[:full]
        if self.sliding is not None:
            try:
                self._hold_sliding(shared[parent.sliding_from:] + copy)
            except OutOfPages:
                self.allocator.decref(copy)
                raise
        self.allocator.incref(p for p in shared if p != RELEASED)
        if copy:
            self._copy_slots(parent.pages[full], copy[0], partial)
        return Sequence(seq_id, parent.token_ids[:computed], pages=shared + copy, num_computed=computed,
                        num_cached=parent.num_cached, partial_kv_before=parent.partial_kv_before,
                        long_rope=parent.long_rope, sliding_from=parent.sliding_from,
                        sliding_to=max(parent.sliding_from, full + len(copy)) if self.sliding else 0)

    def _copy_slots(self, src_page: int, dst_page: int, n: int) -> None:
        """Copy the first `n` slots of a page, K and V of every layer, into another page (and
        the sliding layers' from its partner into the other's)."""
        src, dst = src_page * self.page_size, dst_page * self.page_size
        self.pool.data[:, :, dst : dst + n] = self.pool.data[:, :, src : src + n]
        if self.sliding is not None and self.sliding.has(src_page):
            src, dst = (int(self.sliding.slots(torch.tensor([p * self.page_size]))) for p in (src_page, dst_page))
            self.pool.sliding_data[:, :, dst : dst + n] = self.pool.sliding_data[:, :, src : src + n]

    def forward(
        self,
        work: list[tuple[Sequence, int]],
        on_layer_done: Callable[[int], None] | None = None,
        every_position: Container[int] = (),
        logits: bool = True,
    ) -> torch.Tensor:
        """Compute the next `n` pending positions of each sequence; returns logits at each one's
        last computed position (`[len(work), vocab]`), or at all `n` of them for the indices of
        `work` in `every_position` (prompt logprobs), or none with `logits=False` (a prefill
        node: it only writes K/V). Pages must already be reserved.

        A chunk that ends at a sequence's last token (the one the next token is sampled from)
        computes that token as a one-query slice of its own, the way a decode node computes the
        last prompt token after a hand-off: below float32 the rounding of a chunk's attention
        depends on its length, so this keeps a locally prefilled request token-identical to a
        disaggregated one. The extra slice costs no step and adds no matrix product."""
        ids, positions, slices, rows = [], [], [], []
        total = 0
        for i, (seq, n) in enumerate(work):
            start, end = seq.num_computed, seq.num_computed + n
            if n <= 0 or end > len(seq.token_ids):
                raise ValueError(f"{seq.seq_id}: cannot compute {n} positions from {start} of {len(seq.token_ids)}")
            ids.extend(seq.token_ids[start:end])
            rope_row = self.model.long_rope_offset if seq.long_rope else 0  # its rope table's first row
            positions.append(torch.arange(rope_row + start, rope_row + end))
            every = i in every_position
            if logits and not every and n > 1 and end == len(seq.token_ids):
                slices += [self._slice(seq, start, end - 1), self._slice(seq, end - 1, end)]
            else:
                slices.append(self._slice(seq, start, end))
            total += n
            if logits:
                rows.extend(range(total - n, total) if every else [total - 1])
        batch = ForwardBatch(
            token_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.cat(positions),
            slices=slices,
            logit_rows=torch.tensor(rows, dtype=torch.long),
            sliding_slots=None if self.sliding is None else self.sliding.slots,
        )
        out = self.model.forward(batch, self.pool, on_layer_done)
        for seq, n in work:
            seq.num_computed += n
        return out

    def _slice(self, seq: Sequence, start: int, end: int) -> SequenceSlice:
        """Positions `[start, end)` as queries; with a sliding window the context is only the
        keys they attend, so released pages are never read."""
        if self.window is None:
            return SequenceSlice(end - start, slot_range(seq.pages, self.page_size, 0, end))
        keys = self.window.context_positions(start, end)
        return SequenceSlice(end - start, slots_at(seq.pages, self.page_size, keys),
                             self.window.mask(torch.arange(start, end), keys))

    @locked
    def release_before(self, seq: Sequence, position: int) -> None:
        """Give back the pages of `seq` whose positions all lie before `position` and hold no
        attention sink, and extend its table with released entries up to `position`'s page (a
        receiver that gets only `[position, end)`). Windowed models only."""
        assert self.window is not None, "only a sliding-window model may drop attended pages"
        done = self.window.releasable(seq.pages, self.page_size, position)
        self.allocator.decref(seq.pages[i] for i in done)
        for i in done:
            seq.pages[i] = RELEASED
        seq.pages.extend([RELEASED] * (position // self.page_size - len(seq.pages)))

    @locked
    def placement(self, seq: Sequence, begin: int, end: int) -> Placement:
        """Where a writer puts positions `[begin, end)` of `seq` (PrepareReceive's metadata): their
        slots, and with a sliding group its slots of the positions a sliding layer is sent."""
        full = slot_range(seq.pages, self.page_size, begin, end)
        if self.sliding is None:
            return Placement(Segments.of_slots(full))
        skips = layer_skips(self.model.config, begin, end)
        first = min(skips[i] for i in self.pool.sliding_layers)
        return Placement(Segments.of_slots(full), Segments.of_slots(self.sliding.slots(full[first:])))

    @locked
    def receive_begin(self, seq: Sequence, end: int) -> int:
        """For a receiver: the first position a writer must send (it sends `[begin, end)`) so
        that `seq`, holding its cached prefix, can compute on from `end`. With a sliding window
        the cached pages no query from `end` on attends are given back, and the table skips to
        `begin`'s page, so reserving `end` positions takes only the window's pages."""
        if self.window is None:  # a hybrid model's sliding layers are sent their window only
            if self.sliding is not None:
                self.advance_window(seq, self._first_needed(max(seq.num_computed, end)))
            return seq.num_computed
        begin = self.window.transfer_begin(seq.num_computed, end)
        self.release_before(seq, min(begin, self.window.first_needed(max(seq.num_computed, end))))
        return begin

    @locked
    def trim_to_window(self, seq: Sequence, keep_from: int | None = None) -> None:
        """After a forward: give back the pages no later query of `seq` attends (none without a
        sliding window), keeping every position from `keep_from` on (a transfer still reads it).
        A hybrid model's sliding group gives back the sliding partners its window left."""
        if self.sliding is not None:  # a transfer reads the sliding layers' window of its end only
            needed = self._first_needed(seq.num_computed)
            sent = None if keep_from is None else max(keep_from, self._first_needed(len(seq.token_ids)))
            self.advance_window(seq, needed if sent is None else min(needed, sent))
        if self.window is None or not seq.pages:
            return
        before = self.window.first_needed(seq.num_computed)
        self.release_before(seq, before if keep_from is None else min(before, keep_from))

    @locked
    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Drop the sequence's page references, first recording its computed full pages in the
        prefix cache so later requests can reuse them. Only the leading run of held pages can
        be recorded: a cached page stands for every token before it."""
        held = next((i for i, p in enumerate(seq.pages) if p == RELEASED), len(seq.pages))
        if cache and seq.num_computed:
            self.prefix_cache.insert(seq.token_ids[: min(seq.num_computed, held * self.page_size)], seq.pages[:held],
                                     self._partial_before(seq, held), self.cache_salt(seq.long_rope))
        if self.sliding is not None:
            self.sliding.park(p for p in seq.pages[seq.sliding_from : seq.sliding_to] if p != RELEASED)
        self.allocator.decref(seq.held_pages)
        if cache and seq.num_computed:
            self.room_made.notify_all()  # its pages may have turned evictable
        seq.pages = []
        seq.num_computed = seq.partial_kv_before = seq.sliding_from = seq.sliding_to = 0

    def _partial_before(self, seq: Sequence, held: int) -> int:
        """The end of the last of `seq`'s first `held` pages that lacks some layers' K/V: of those
        past its window, the ones whose sliding K/V went (or never came)."""
        lacking = seq.partial_kv_before
        if self.sliding is not None:
            gone = [i for i in range(min(seq.sliding_from, held)) if not self.sliding.has(seq.pages[i])]
            lacking = max(lacking, (gone[-1] + 1) * self.page_size if gone else 0)
        return lacking

    @locked
    def outgrow_short_rope(self, seq: Sequence) -> bool:
        """Longrope: once `seq` holds more tokens than the original context, its K/V (short
        factors) goes back, into the prefix cache, and it turns long, to be computed again from its
        first token (or from the long-factor pages the cache holds of it), as transformers
        recomputes its cache at that step. True when it did: the caller schedules that prefill."""
        if seq.long_rope or not self.long_rope(len(seq.token_ids)):
            return False
        self.release(seq)
        seq.long_rope = True
        return True
