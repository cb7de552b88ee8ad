"""What the prefix cache does with the sliding partners of the pages it records
(common/kv/sliding_pages.py), as a policy: `HeldPartners` for a hybrid model whose sliding layers
have a group of their own, `NoPartners` for every other model, so the cache never asks which.

With a sliding group, a page whose sliding K/V went is partial (prefix_cache.py, "Partial
pages"): the cache holds the partner of every whole page it records and, when the group runs
short, gives up those of its least recently used pages (`PrefixCache.evict_for_sliding`: they
turn partial).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from common.kv.page_allocator import PageAllocator
from common.kv.radix_trie import TrieNode
from common.kv.sliding_pages import SlidingPages


class PartnerPolicy(Protocol):
    def hold(self, page: int) -> None:
        """The cache starts recording `page` whole."""

    def drop(self, node: TrieNode) -> None:
        """The cache stops recording `node`."""

    def give_up(self, nodes: Iterable[TrieNode], n: int, remove_tail: Callable[[TrieNode], None]) -> None:
        """Free up to `n` sliding pages from the partners of `nodes` (`remove_tail`: the cache
        forgets a tail)."""


class NoPartners:
    """A model without a sliding group: its pages have no partners."""

    def hold(self, page: int) -> None:
        pass

    def drop(self, node: TrieNode) -> None:
        pass

    def give_up(self, nodes: Iterable[TrieNode], n: int, remove_tail: Callable[[TrieNode], None]) -> None:
        pass


class HeldPartners:
    """The cache holds the partner of every whole page it records."""

    def __init__(self, sliding: SlidingPages, allocator: PageAllocator) -> None:
        self.sliding = sliding
        self.allocator = allocator

    def hold(self, page: int) -> None:
        """A whole page's sliding K/V stays while the cache records it (the recorder holds it)."""
        self.sliding.hold([page], make=False)

    def drop(self, node: TrieNode) -> None:
        if not node.partial:
            self.sliding.drop([node.page])

    def give_up(self, nodes: Iterable[TrieNode], n: int, remove_tail: Callable[[TrieNode], None]) -> None:
        """The sliding K/V of up to `n` whole pages that only the cache keeps goes, least recently
        used first: a full page stays, partial (it still serves a match whose window does not
        reach it); a tail goes with it (a partial tail is not recorded), so one is given up only
        where the cache alone holds its page too."""
        whole = [node for node in nodes if not node.partial and self.sliding.holders(node.page) == 1 and (
            not node.is_tail or self.allocator.refcount(node.page) == 1)]
        for node in sorted(whole, key=lambda node: node.last_access)[:n]:
            if node.is_tail:
                remove_tail(node)
            else:
                self.drop(node)
                node.partial = True
