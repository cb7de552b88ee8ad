"""The record of what enters and leaves a prefix cache, for watchers on other nodes.

The cache reports each full page it starts or stops holding by its block hash
(common/kv/block_hashes.py) and calls `publish` at the end of each operation; what changed since
the last `publish` becomes one numbered change (`KvChange`). Within a change only a block's final
state counts (stored then removed is a removal), so applying changes in order, idempotently
(add the stored, discard the removed), rebuilds the cache's set of blocks.

Each stored block also carries what vLLM-format subscribers need (common/serving/kv_events_zmq.py):
the block before it (None for a prompt's first) and its tokens.

Blocks are held in a **medium**: `POOL` (the KV pool's prefix cache) or `DISK` (the offload tier,
common/kv/disk_tier.py, whose pages are read back into the pool before use). Each change is about
one medium; a publish that touched both makes two consecutive changes.

A watcher starts from `snapshot()` (every block held, with the sequence it reflects) and follows
`changes_after`; the last `history` changes are kept, so a watcher that lost its stream can resume
without a snapshot if it was not gone long. A restart gives the log a new `incarnation`, so a
watcher can tell it must start over. Thread-safe: the cache writes under its owner's lock while
server threads read.
"""
from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass


POOL = "pool"
DISK = "disk"
MEDIA = (POOL, DISK)


@dataclass(frozen=True)
class StoredBlock:
    block_hash: int
    parent: int | None  # the hash of the block before it; None: it starts its prompt
    token_ids: tuple[int, ...]  # a full page


@dataclass(frozen=True)
class KvChange:
    sequence: int  # the log's state after this change; consecutive
    stored: tuple[int, ...]
    removed: tuple[int, ...]
    stored_blocks: tuple[StoredBlock, ...] = ()  # `stored`, in order, with parents and tokens
    medium: str = POOL  # where `stored` and `removed` are held


class KvEventLog:
    def __init__(self, block_size: int, history: int = 1024) -> None:
        self.block_size = block_size
        self.incarnation = secrets.token_hex(8)
        self._cond = threading.Condition()
        self._blocks: dict[str, dict[int, StoredBlock]] = {m: {} for m in MEDIA}  # held, in the order stored
        self._pending: dict[str, dict[int, bool]] = {m: {} for m in MEDIA}  # hash -> held, since the last publish
        self._sequence = 0
        self._history: deque[KvChange] = deque(maxlen=history)

    @property
    def sequence(self) -> int:
        with self._cond:
            return self._sequence

    def count(self, medium: str = POOL) -> int:
        """Blocks held in `medium`."""
        with self._cond:
            return len(self._blocks[medium])

    @property
    def num_blocks(self) -> int:
        return self.count(POOL)

    def stored(self, block_hash: int, parent: int | None = None, token_ids: tuple[int, ...] = (),
               medium: str = POOL) -> None:
        with self._cond:
            blocks, pending = self._blocks[medium], self._pending[medium]
            blocks.pop(block_hash, None)
            blocks[block_hash] = StoredBlock(block_hash, parent, token_ids)
            pending.pop(block_hash, None)  # a parent re-stored goes before its children
            pending[block_hash] = True

    def removed(self, block_hash: int, medium: str = POOL) -> None:
        with self._cond:
            self._blocks[medium].pop(block_hash, None)
            self._pending[medium].pop(block_hash, None)
            self._pending[medium][block_hash] = False

    def publish(self) -> None:
        """Turn what changed since the last call into one change and wake the watchers."""
        with self._cond:
            self._publish_locked()

    def snapshot(self, medium: str = POOL) -> tuple[int, list[int]]:
        """(sequence, every block held in `medium` after that change)."""
        sequence, blocks = self.snapshot_blocks()
        return sequence, [b.block_hash for b in blocks[medium]]

    def snapshot_blocks(self) -> tuple[int, dict[str, list[StoredBlock]]]:
        """(sequence, by medium every block held after that change, each after its parent)."""
        with self._cond:
            self._publish_locked()
            return self._sequence, {m: list(blocks.values()) for m, blocks in self._blocks.items()}

    def changes_after(self, sequence: int) -> list[KvChange] | None:
        """The changes after `sequence` (none when it is the latest), or None when the history no
        longer reaches back to it: take a snapshot. `sequence` must not be ahead of the log."""
        with self._cond:
            if sequence > self._sequence:
                raise ValueError(f"sequence {sequence} is ahead of the log's {self._sequence}")
            missing = self._sequence - sequence
            if missing > len(self._history):
                return None
            return list(self._history)[len(self._history) - missing :]

    def wait(self, sequence: int, timeout: float) -> bool:
        """Block until a change after `sequence` exists or `timeout` passes; True if one does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._sequence > sequence, timeout)

    def _publish_locked(self) -> None:
        for medium, pending in self._pending.items():
            if not pending:
                continue
            stored = tuple(h for h, held in pending.items() if held)
            removed = tuple(h for h, held in pending.items() if not held)
            pending.clear()
            self._sequence += 1
            blocks = self._blocks[medium]
            self._history.append(KvChange(self._sequence, stored, removed, tuple(blocks[h] for h in stored), medium))
            self._cond.notify_all()
