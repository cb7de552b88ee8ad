"""The disk tier (common/kv/disk_tier.py) and the engine's use of it (common/engine/kv_offload.py):
pages written through, read back bit for bit, bad files detected and never served, LRU within
the capacity, the index rebuilt from the files (a warm restart), every page reference returned."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from common.engine.core import Engine
from common.engine.kv_offload import KvOffload
from common.kv.block_hashes import ROOT_HASH, block_hashes, chain_hash
from common.kv.disk_tier import CHECKSUM, FOREIGN, TORN, DiskTier
from common.kv.events import DISK, POOL, KvEventLog
from harness.helpers import random_ids

PAGE = 4


def _payload(seed: int, size: int = 64) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(size))


def _blocks(n: int, seed: int = 0) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent, tokens) of `n` chained blocks of PAGE tokens."""
    tokens = random_ids(n * PAGE, seed)
    out, parent = [], None
    for i in range(n):
        block = tuple(tokens[i * PAGE : (i + 1) * PAGE])
        h = chain_hash(ROOT_HASH if parent is None else parent, block)
        out.append((h, parent, block))
        parent = h
    return out


def _tier(path: Path, capacity: int = 1 << 20, fingerprint: str = "model=a", events: KvEventLog | None = None):
    return DiskTier(path, capacity, fingerprint, 64, events)


def _file(tier: DiskTier, block_hash: int) -> Path:
    return tier.directory / f"{block_hash:016x}.kv"


def test_written_pages_read_back_and_survive_a_restart(tmp_path):
    events = KvEventLog(PAGE)
    tier = _tier(tmp_path, events=events)
    blocks = _blocks(3)
    for i, (h, parent, tokens) in enumerate(blocks):
        assert tier.write(h, parent, tokens, _payload(i))
    assert all(h in tier for h, _, _ in blocks) and 12345 not in tier
    assert tier.read(blocks[1][0], blocks[1][2]) == _payload(1)
    assert events.count(DISK) == 3 and events.count(POOL) == 0
    assert tier.read(blocks[1][0], (1, 2, 3, 4)) is None  # another prefix's tokens: never served

    again_events = KvEventLog(PAGE)
    again = _tier(tmp_path, events=again_events)  # a restarted node on the same directory
    assert again.num_blocks == 3 and again.bytes_used == tier.bytes_used
    assert [b.block_hash for b in again_events.snapshot_blocks()[1][DISK]] == [h for h, _, _ in blocks]
    assert again.read(blocks[2][0], blocks[2][2]) == _payload(2)


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-1] + bytes([data[-1] ^ 0x40]), CHECKSUM),  # a flipped bit in the KV
    (lambda data: data[: len(data) - 10], TORN),  # truncated
    (lambda data: data[:12] + b"x" + data[13:], TORN),  # garbled header
])
def test_a_damaged_file_is_a_counted_miss_and_deleted(tmp_path, damage, reason):
    tier = _tier(tmp_path)
    (h, parent, tokens), = _blocks(1)
    tier.write(h, parent, tokens, _payload(7))
    path = _file(tier, h)
    path.write_bytes(damage(path.read_bytes()))
    assert tier.read(h, tokens) is None
    assert tier.errors[reason] == 1 and not path.exists() and h not in tier


def test_damage_found_at_restart_and_leftovers_removed(tmp_path):
    tier = _tier(tmp_path)
    (h1, p1, t1), (h2, p2, t2) = _blocks(2)
    tier.write(h1, p1, t1, _payload(1))
    tier.write(h2, p2, t2, _payload(2))
    _file(tier, h2).write_bytes(_file(tier, h2).read_bytes()[:-5])
    (tier.directory / ".tmp-abc-0000000000000001.kv").write_bytes(b"half a write")
    again = _tier(tmp_path)
    assert h1 in again and h2 not in again and again.errors[TORN] == 1
    assert sorted(p.name for p in again.directory.iterdir()) == [_file(tier, h1).name]


def test_another_fingerprint_is_a_miss(tmp_path):
    ours = _tier(tmp_path, fingerprint="model=a")
    theirs = _tier(tmp_path, fingerprint="model=b")
    assert ours.directory != theirs.directory  # nodes of other models share a directory safely
    (h, parent, tokens), = _blocks(1)
    theirs.write(h, parent, tokens, _payload(3))
    _file(ours, h).write_bytes(_file(theirs, h).read_bytes())  # copied where it does not belong
    again = _tier(tmp_path, fingerprint="model=a")
    assert h not in again and again.errors[FOREIGN] == 1


def test_least_recently_used_pages_go_past_the_capacity(tmp_path):
    blocks = _blocks(4)
    probe = _tier(tmp_path / "probe")
    for i, block in enumerate(blocks[:3]):
        probe.write(*block, _payload(i))
    tier = _tier(tmp_path / "tier", capacity=probe.bytes_used + 32)  # three files, not four
    for i, block in enumerate(blocks[:3]):
        tier.write(*block, _payload(i))
    tier.read(blocks[0][0], blocks[0][2])  # now the most recently used
    tier.write(*blocks[3], _payload(3))
    assert [b[0] in tier for b in blocks] == [True, False, True, True]
    assert tier.bytes_used <= tier.capacity_bytes and not _file(tier, blocks[1][0]).exists()


def _computed(engine: Engine, seq_id: str, tokens: list[int]):
    seq = engine.new_sequence(seq_id, tokens)
    with engine.lock:
        engine.reserve(seq, len(tokens))
    engine.forward([(seq, len(tokens) - seq.num_computed)])
    return seq


def _kv(engine: Engine, pages: list[int], n: int) -> torch.Tensor:
    ps = engine.page_size
    slots = torch.tensor([p * ps + i for p in pages for i in range(ps)])[:n]
    return engine.pool.data[:, :, slots].clone()


def _wait_written(offload: KvOffload, pages: int) -> None:
    deadline = time.monotonic() + 10
    while offload.stats.pages_written < pages:
        assert time.monotonic() < deadline, f"only {offload.stats.pages_written} of {pages} pages written"
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_evicted_prefix_read_back_bit_for_bit(tmp_path, model, model_bf16, dtype):
    """The KV the pool evicted comes back from disk identical, the prompt's match covers it, a
    damaged page ends the read-back there, and every page reference is returned."""
    engine = Engine(model if dtype is torch.float32 else model_bf16, 32, 16)
    pool = engine.pool
    tier = DiskTier(tmp_path, 1 << 30, "test", pool.num_layers * 2 * 16 * pool.slot_bytes(), engine.kv_events)
    offload = KvOffload(engine, tier)
    try:
        prompt = random_ids(100, seed=5)
        seq = _computed(engine, "a", prompt)
        reference = _kv(engine, seq.pages, 96)
        with engine.lock:
            engine.release(seq)
        _wait_written(offload, 6)
        with engine.lock:
            engine.prefix_cache.clear()
        assert engine.allocator.num_free == 32  # the writer gave every page back

        got = offload.read_back(prompt[:-1])
        assert got.tokens == 96 and got.bytes == 6 * tier.payload_bytes
        again = engine.new_sequence("b", prompt)
        assert again.num_computed == 96 and torch.equal(_kv(engine, again.pages, 96), reference)
        with engine.lock:
            engine.release(again)
            engine.prefix_cache.clear()

        hashes = block_hashes(prompt, 16)
        path = _file(tier, hashes[3])
        path.write_bytes(path.read_bytes()[:-1] + b"\x00")
        got = offload.read_back(prompt[:-1])
        assert got.tokens == 48 and tier.errors[CHECKSUM] == 1  # pages 0-2; page 3 is computed again
        assert engine.new_sequence("c", prompt).num_computed == 48
    finally:
        offload.close()
