"""Which node holds which KV block, as the nodes' WatchKvEvents streams report it.

Per node: the incarnation and last sequence applied, the block size, and the set of block hashes
(common/kv/block_hashes.py) its prefix cache holds, and those its disk tier holds (events with
`medium` "disk"): a prompt's prefix counts as held where either has it, since a node reads a disk
block back far faster than it computes it. A snapshot replaces a node's set; any other
event must be the next of the same incarnation, or `apply` refuses it and the caller resyncs with
a fresh watch. Routing also notes the prompts it just sent somewhere (`note_routed`): those
blocks count as held there for a while, since the node reports them only once the request ends,
and a conversation's next turn or a burst sharing a system prompt should follow them.

Everything here is a hint: a block believed held that is gone costs a prefill, never a wrong
answer, since a node matches its own cache on every request.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.kv.block_hashes import block_hashes
from protos.duet.v1 import duet_pb2 as pb

PREDICTION_SECONDS = 30.0  # how long a routed prompt's blocks count as held before its node confirms them
_PRUNE_ABOVE = 4096  # predicted blocks per node past which the expired ones are dropped


@dataclass
class _NodeBlocks:
    incarnation: str
    sequence: int
    block_size: int
    blocks: set[int] = field(default_factory=set)  # in the KV pool
    on_disk: set[int] = field(default_factory=set)  # in the --kv-offload-dir tier (read back on use)


class KvIndex:
    def __init__(self, prediction_seconds: float = PREDICTION_SECONDS) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, _NodeBlocks] = {}
        self._predicted: dict[str, dict[int, float]] = {}  # address -> block hash -> expiry (monotonic)
        self._block_sizes: dict[str, int] = {}  # survives forget(): the size to predict with
        self._prediction_seconds = prediction_seconds

    def apply(self, address: str, event: pb.KvEvent) -> bool:
        """Apply one event from `address`'s stream; False (nothing applied) when it does not
        follow what was applied before, or its snapshot names no usable block size, so the node
        must be resynced."""
        with self._lock:
            node = self._nodes.get(address)
            if event.snapshot and not event.medium:
                if event.block_size < 1:
                    return False
                self._nodes[address] = _NodeBlocks(event.incarnation, event.sequence, event.block_size,
                                                   set(event.stored_blocks))
                self._block_sizes[address] = event.block_size
                return True
            if node is None or node.incarnation != event.incarnation:
                return False
            held = node.on_disk if event.medium else node.blocks
            if event.snapshot and event.sequence == node.sequence:  # the disk tier's part of a snapshot
                held.clear()
            elif event.sequence != node.sequence + 1:
                return False
            held.difference_update(event.removed_blocks)
            held.update(event.stored_blocks)
            node.sequence = event.sequence
            predicted = self._predicted.get(address)
            if predicted:
                for h in event.removed_blocks:
                    predicted.pop(h, None)
            return True

    def forget(self, address: str) -> None:
        """Drop what is known of a node (its stream broke off without a resumable point)."""
        with self._lock:
            self._nodes.pop(address, None)
            self._predicted.pop(address, None)

    def resume_point(self, address: str) -> tuple[str, int] | None:
        """(incarnation, last sequence applied) to resume a dropped watch from, if any."""
        with self._lock:
            node = self._nodes.get(address)
            return None if node is None else (node.incarnation, node.sequence)

    def num_blocks(self, address: str) -> int:
        with self._lock:
            node = self._nodes.get(address)
            return 0 if node is None else len(node.blocks)

    def note_routed(self, address: str, token_ids: Sequence[int]) -> None:
        """A prompt was just sent to `address`: count its blocks as held there for a while."""
        with self._lock:
            size = self._block_sizes.get(address)
            if size is None:
                return
            now = time.monotonic()
            predicted = self._predicted.setdefault(address, {})
            if len(predicted) > _PRUNE_ABOVE:
                predicted = self._predicted[address] = {h: t for h, t in predicted.items() if t > now}
            for h in block_hashes(token_ids, size):
                predicted[h] = now + self._prediction_seconds

    def cached_tokens(self, addresses: Sequence[str], token_ids: Sequence[int]) -> dict[str, int]:
        """For each address: how many leading tokens of `token_ids` it holds in whole blocks."""
        hashes_by_size: dict[int, list[int]] = {}
        out: dict[str, int] = {}
        now = time.monotonic()
        with self._lock:
            for address in addresses:
                size = self._block_sizes.get(address)
                if size is None:
                    out[address] = 0
                    continue
                if size not in hashes_by_size:
                    hashes_by_size[size] = block_hashes(token_ids, size)
                node = self._nodes.get(address)
                held, on_disk = (node.blocks, node.on_disk) if node is not None else (set(), set())
                predicted = self._predicted.get(address, {})
                run = 0
                for h in hashes_by_size[size]:
                    if h not in held and h not in on_disk and predicted.get(h, 0.0) <= now:
                        break
                    run += 1
                out[address] = run * size
        return out
