"""Test-only fault injection into the KV this node sends, off unless the environment variable
DUET_TEST_FAULTS names a fault (comma-separated):

- `corrupt-kv`: every transfer sends one position of its first layer from the wrong source slot
  (the next one): bytes that arrive intact but are not the bytes the checksums describe, which
  only the decode node's --verify-kv can notice.
"""
from __future__ import annotations

import os

from common.kv.pool import KVPool
from common.transports.connector import Transfer
from common.transports.pieces import Piece

FAULTS = frozenset(f for f in os.environ.get("DUET_TEST_FAULTS", "").split(",") if f)


class _Misdirected:
    """A transfer whose first posted piece of layer 0 starts from a neighbouring source slot."""

    def __init__(self, inner: Transfer, pool: KVPool) -> None:
        self._inner, self._pool, self._corrupted = inner, pool, False

    @property
    def failed(self) -> bool:
        return self._inner.failed

    def post_layer(self, layer: int, pieces: list[Piece]) -> None:
        if layer == 0 and pieces and not self._corrupted:
            self._corrupted = True
            p = pieces[0]
            wrong = p.src_slot + 1 if p.src_slot + 1 < self._pool.slots_of(layer) else p.src_slot - 1
            rest = [Piece(p.src_slot + 1, p.dst_slot + 1, p.num_slots - 1)] if p.num_slots > 1 else []
            pieces = [Piece(wrong, p.dst_slot, 1), *rest, *pieces[1:]]
        self._inner.post_layer(layer, pieces)

    def finish(self) -> None:
        self._inner.finish()

    def cancel(self) -> bool:
        return self._inner.cancel()


def with_faults(transfer: Transfer, pool: KVPool) -> Transfer:
    return _Misdirected(transfer, pool) if "corrupt-kv" in FAULTS else transfer
