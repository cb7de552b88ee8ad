"""Chained block hashes and the KV event log a prefix cache feeds (the watch protocol over gRPC is
in tests/daemons/test_kv_routing.py)."""
from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest
import zmq

from common.kv.block_hashes import ROOT_HASH, block_hashes, chain_hash
from common.kv.events import DISK, POOL, KvEventLog
from common.kv.page_allocator import PageAllocator
from common.kv.prefix_cache import PrefixCache
from common.serving.kv_events_zmq import END_OF_REPLAY, KvEventPublisher
from harness.local_daemons import free_port


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


def test_each_medium_changes_on_its_own_and_snapshots_by_medium():
    log = KvEventLog(4)
    log.stored(1)
    log.stored(2, medium=DISK)
    log.removed(3, medium=DISK)
    log.publish()  # two media touched: two consecutive changes
    assert [(c.sequence, c.medium, c.stored, c.removed) for c in log.changes_after(0)] == [
        (1, POOL, (1,), ()), (2, DISK, (2,), (3,))]
    assert log.num_blocks == log.count(POOL) == 1 and log.count(DISK) == 1
    sequence, media = log.snapshot_blocks()
    assert sequence == 2 and {m: [b.block_hash for b in bs] for m, bs in media.items()} == {POOL: [1], DISK: [2]}
    assert log.snapshot(DISK) == (2, [2])


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
    first, second = block_hashes(tokens, 4)
    assert [(b.block_hash, b.parent, b.token_ids) for b in change.stored_blocks] == [
        (first, None, (0, 1, 2, 3)), (second, first, (4, 5, 6, 7))]  # what vLLM-format events carry
    assert cache.evict(8) == 3  # the tail and both pages, one published change
    (change,) = log.changes_after(1)
    assert set(change.removed) == set(block_hashes(tokens, 4)) and change.stored == ()
    assert log.num_blocks == 0


def test_the_zmq_publisher_chains_stored_blocks_and_answers_replays():
    """vLLM's wire format from a log (the daemons' contract is tests/http/test_inference_gateway.py)."""
    context = zmq.Context()
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    log = KvEventLog(4)
    sub = context.socket(zmq.SUB)
    sub.bind(endpoint)  # as llm-d's picker: it binds, the pods' publishers connect
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = KvEventPublisher(log, endpoint, "kv@h:1@m", "CPU", replay_endpoint)
    publisher.start()

    def received() -> tuple[bytes, int, list]:
        topic, sequence, payload = sub.recv_multipart()
        return topic, int.from_bytes(sequence, "big"), msgpack.unpackb(payload)[1]

    try:
        # PUB/SUB drops what goes out before the subscription has crossed (the replay socket is
        # for that): publish a probe until one arrives.
        for _ in range(100):
            log.stored(99, None, (0, 0, 0, 0))
            log.removed(99)
            log.publish()
            if sub.poll(100):
                break
        while sub.poll(300):
            probe = received()
        log.stored(11, None, (1, 2, 3, 4))
        log.stored(12, 11, (5, 6, 7, 8))  # continues 11: one chain
        log.stored(21, None, (9, 9, 9, 9))  # another prompt's first page
        log.publish()
        log.removed(12)
        log.publish()
        log.stored(12, 11, (5, 6, 7, 8), medium=DISK)  # kept by the disk tier
        log.publish()
        got = []
        for _ in range(3):
            assert sub.poll(5000)
            got.append(received())
        first = probe[1] + 1
        assert got == [(b"kv@h:1@m", first, [["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU"],
                                             ["BlockStored", [21], None, [9, 9, 9, 9], 4, None, "CPU"]]),
                       (b"kv@h:1@m", first + 1, [["BlockRemoved", [12], "CPU"]]),
                       (b"kv@h:1@m", first + 2, [["BlockStored", [12], 11, [5, 6, 7, 8], 4, None, "DISK"]])]
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while not replayed or replayed[-1][0] != END_OF_REPLAY:
            assert dealer.poll(5000)
            replayed.append(dealer.recv_multipart()[1:])
        assert [int.from_bytes(r[0], "big", signed=True) for r in replayed] == [*range(first + 3), -1]
        assert msgpack.unpackb(replayed[0][1])[1] == [["AllBlocksCleared"]]  # the first message: a reset
        assert replayed[-1][1] == b""
        dealer.send_multipart([b"", b"not a sequence"])  # malformed: nothing but the end marker
        assert dealer.poll(5000) and dealer.recv_multipart()[1:] == [END_OF_REPLAY, b""]
        dealer.close()
    finally:
        publisher.stop()
        sub.close()
        context.term()
    with pytest.raises(ValueError, match="--kv-events-endpoint"):
        KvEventPublisher(log, "nonsense://x", "t", "CPU")
    with pytest.raises(ValueError, match="--kv-events-replay-endpoint"):  # the PUB socket opened is closed
        KvEventPublisher(log, f"tcp://127.0.0.1:{free_port()}", "t", "CPU", "nonsense://x")
