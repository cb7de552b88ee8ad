"""A hybrid model's sliding-layer K/V on pages of its own (Gemma 2/3, gpt-oss).

The pool holds two groups of layers (common/kv/pool.py): the full-attention layers on the pages
that page tables, the prefix cache and the wire name, and the sliding layers on *sliding pages*,
fewer, each one the **partner** of a full page: the sliding layers' K/V of the positions on full
page `p` lie on sliding page `partner(p)`, at the same offsets. A full page has a partner only
while a holder needs its sliding K/V: a sequence whose window reaches the page, the prefix cache
for a page it records whole, a write fence. So a request keeps its whole prompt's K/V in the full
layers but only its window's in the sliding ones, and the sliding pages that fall behind every
holder's window go back.

Partners are reference counted on an allocator of their own: `hold` takes one reference on the
partner of each page (making one where the page has none: its sliding K/V is still to be
written), `drop` gives one back; the partner goes when its last holder drops it, the full page
stays as long as its own holders keep it.

A sequence whose window moves past a page **parks** its reference instead (`park`): the K/V stays
where it is, serving a later prompt that starts with the same tokens (a shared system prompt: the
prefix cache records the page whole), until the group needs the page (`unpark`, least recently
parked first) or the full page itself is freed (`forget`). Not thread-safe: the engine's lock
guards it, as it guards the full pages' allocator.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from common.kv.page_allocator import PageAllocator

NO_PARTNER = -1


class SlidingPages:
    def __init__(self, num_full_pages: int, num_pages: int, page_size: int,
                 on_free: Callable[[], None] = lambda: None) -> None:
        self.allocator = PageAllocator(num_pages, lambda pages: on_free())
        self.page_size = page_size
        self._partner = torch.full((num_full_pages,), NO_PARTNER, dtype=torch.long)
        self._parked: OrderedDict[int, None] = OrderedDict()  # full pages whose partner holds a parked reference

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def has(self, page: int) -> bool:
        """Whether full page `page` has its sliding K/V (a partner)."""
        return int(self._partner[page]) != NO_PARTNER

    def holders(self, page: int) -> int:
        """References on full page `page`'s partner (0: it has none)."""
        partner = int(self._partner[page])
        return 0 if partner == NO_PARTNER else self.allocator.refcount(partner)

    def missing(self, pages: Iterable[int]) -> int:
        """How many of `pages` have no partner: the sliding pages `hold` would take."""
        return sum(1 for p in pages if int(self._partner[p]) == NO_PARTNER)

    def hold(self, pages: Iterable[int], make: bool = True) -> None:
        """One reference on the partner of each of the (distinct) pages; with `make`, partners
        are made where missing (their K/V still to be written), all or nothing: raises OutOfPages
        when too few sliding pages are free. Without, a page must already have one."""
        pages = list(pages)
        fresh = [p for p in pages if int(self._partner[p]) == NO_PARTNER]
        if fresh and not make:
            raise RuntimeError(f"page {fresh[0]} has no sliding K/V to keep")
        made = self.allocator.allocate(len(fresh))  # raises OutOfPages, changing nothing
        self.allocator.incref(int(self._partner[p]) for p in pages if int(self._partner[p]) != NO_PARTNER)
        if fresh:
            self._partner[fresh] = torch.tensor(made, dtype=torch.long)

    def drop(self, pages: Iterable[int]) -> None:
        """Give back one reference on the partner of each page; a partner whose last holder
        dropped it goes back to the free sliding pages."""
        pages = list(pages)
        partners = [int(self._partner[p]) for p in pages]
        if NO_PARTNER in partners:
            raise ValueError(f"page {pages[partners.index(NO_PARTNER)]} has no sliding partner to drop")
        freed = set(self.allocator.decref(partners))
        for p, s in zip(pages, partners):
            if s in freed:
                self._partner[p] = NO_PARTNER

    def park(self, pages: Iterable[int]) -> None:
        """Turn one reference on the partner of each page into the parked one (a page has one
        parked reference at most: another is dropped)."""
        pages = list(pages)
        self.drop(p for p in pages if p in self._parked)
        self._parked.update((p, None) for p in pages if p not in self._parked)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def unpark(self, n: int) -> None:
        """Drop parked references, least recently parked first, until `n` sliding pages more are
        free or none is parked."""
        goal = self.allocator.num_free + n
        while self._parked and self.allocator.num_free < goal:
            page, _ = self._parked.popitem(last=False)
            self.drop([page])

    def forget(self, freed: Iterable[int]) -> None:
        """Full pages went back to their allocator: their parked references go (no other holder
        of a partner is left once its page is free)."""
        gone = [p for p in freed if p in self._parked]
        for p in gone:
            del self._parked[p]
        self.drop(gone)

    def slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The sliding slots of positions at `full_slots` (each on a page that has a partner)."""
        ps = self.page_size
        partners = self._partner[full_slots // ps]
        if bool((partners == NO_PARTNER).any()):
            raise RuntimeError("a sliding layer's position lies on a page without its sliding K/V: "
                               "the window bookkeeping is wrong")
        return partners * ps + full_slots % ps
