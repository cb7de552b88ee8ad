"""Chained block hashes and the KV event log a prefix cache feeds (the watch protocol over gRPC is
in tests/test_kv_routing.py)."""
from __future__ import annotations

import hashlib
import struct

import pytest

from common.kv.block_hashes import ROOT_HASH, block_hashes, chain_hash
from common.kv.events import KvEventLog
from common.kv.page_allocator import PageAllocator
from common.kv.prefix_cache import PrefixCache


def test_a_block_hash_covers_every_token_before_it():
    a, b = list(range(12)), [99] + list(range(1, 12))
    assert block_hashes(a, 4)[0] == chain_hash(ROOT_HASH, a[:4])
    assert block_hashes(a, 4)[1] == chain_hash(block_hashes(a, 4)[0], a[4:8])
    # Only the first token differs, yet every block's hash does: a hash names a whole prefix.
    assert all(x != y for x, y in zip(block_hashes(a, 4), block_hashes(b, 4)))
    assert block_hashes(a[:11], 4) == block_hashes(a, 4)[:2]  # no hash for a partial block
    assert block_hashes(a, 4) == block_hashes(tuple(a), 4)  # any int sequence
    with pytest.raises(ValueError):
        block_hashes(a, 0)


def test_a_hash_is_the_documented_digest():
    # The router and every node must agree without talking: no per-process salt, a fixed layout.
    digest = hashlib.blake2b(bytes(8) + struct.pack("<4i", 1, 2, 3, 4), digest_size=8).digest()
    assert chain_hash(ROOT_HASH, [1, 2, 3, 4]) == int.from_bytes(digest, "little") == 658132497017838498


def test_the_log_numbers_changes_and_keeps_only_final_states():
    log = KvEventLog(4, history=2)
    log.stored(1)
    log.stored(2)
    log.removed(2)  # stored then removed before publishing: a removal
    log.publish()
    log.publish()  # nothing changed: no change
    assert log.sequence == 1
    assert [(c.sequence, c.stored, c.removed) for c in log.changes_after(0)] == [(1, (1,), (2,))]
    log.stored(3)
    log.publish()
    log.removed(1)
    log.publish()
    assert log.changes_after(3) == []
    assert [c.sequence for c in log.changes_after(1)] == [2, 3]
    assert log.changes_after(0) is None  # beyond the history: take a snapshot
    assert log.snapshot() == (3, [3])
    with pytest.raises(ValueError):
        log.changes_after(4)
    assert log.wait(2, timeout=0) and not log.wait(3, timeout=0.01)
    assert KvEventLog(4).incarnation != log.incarnation


def test_a_prefix_cache_reports_full_pages_but_not_tails():
    allocator = PageAllocator(8)
    log = KvEventLog(4)
    cache = PrefixCache(allocator, 4, log)
    tokens = list(range(10))  # two full pages and a tail
    pages = allocator.allocate(3)
    cache.insert(tokens, pages)
    allocator.decref(pages)
    (change,) = log.changes_after(0)
    assert set(change.stored) == set(block_hashes(tokens, 4)) and change.removed == ()
    assert cache.evict(8) == 3  # the tail and both pages, one published change
    (change,) = log.changes_after(1)
    assert set(change.removed) == set(block_hashes(tokens, 4)) and change.stored == ()
    assert log.num_blocks == 0
