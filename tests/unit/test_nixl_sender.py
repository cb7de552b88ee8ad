"""The NIXL sender's transfer (common/transports/nixl/sender.py) with a stand-in initiator: a
failure on the sender thread, of any kind, must fail the transfer, never let it be confirmed."""
from __future__ import annotations

import pytest
import torch

from common.errors import ErrorCode
from common.kv.pool import KVPool
from common.transports import TransferError
from common.transports.pieces import Piece
from common.transports.nixl import sender as nixl_sender
from common.transports.nixl.sender import NixlTransfer, _Peer

PIECES = [Piece(src_slot=0, dst_slot=4, num_slots=4)]


class _Initiator:
    """Records the writes; raises `error` at the write of layer `fail_layer`."""

    def __init__(self, pool: KVPool, fail_layer: int | None = None, error: Exception | None = None) -> None:
        self.layer_bytes = pool.data[0].numel() * pool.data.element_size()
        self.base = pool.data.data_ptr()
        self.num_pages = pool.num_pages
        self.fail_layer, self.error = fail_layer, error
        self.written: list[int] = []

    def write(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> int:
        return self._record((local[0][0] - self.base) // self.layer_bytes)

    def write_blocks(self, peer: str, local, remote, nbytes: int) -> int:
        """Prepared page blocks: block (layer * 2 + kv) * num_pages + page."""
        return self._record(int(local[0]) // (2 * self.num_pages))

    def _record(self, layer: int) -> int:
        if layer == self.fail_layer:
            raise self.error
        self.written.append(layer)
        return layer

    def is_done(self, handle: int) -> bool:
        return True

    def wait(self, handle: int, timeout_s: float) -> None:
        pass


def _session(initiator: _Initiator, pool: KVPool, done: list[int]) -> NixlTransfer:
    return NixlTransfer(initiator, pool, _Peer("decode", base_address=1 << 20, layout=pool.layout), 5.0,
                       done.append)


@pytest.fixture
def pool() -> KVPool:
    return KVPool(num_layers=3, num_kv_heads=1, head_dim=4, num_pages=4, page_size=4, dtype=torch.float32)


def test_all_layers_posted_and_reported(pool):
    initiator, done = _Initiator(pool), []
    session = _session(initiator, pool, done)
    for layer in range(3):
        session.post_layer(layer, PIECES)
    session.finish()
    assert initiator.written == done == [0, 1, 2] and not session.failed


@pytest.mark.parametrize("error, code", [
    (TransferError("refused", ErrorCode.INVALID_ARGUMENT), ErrorCode.INVALID_ARGUMENT),
    (ValueError("ranges out of the registered tensor"), ErrorCode.INTERNAL),
])
def test_a_failed_post_fails_the_transfer(pool, error, code):
    initiator, done = _Initiator(pool, fail_layer=1, error=error), []
    session = _session(initiator, pool, done)
    for layer in range(3):
        session.post_layer(layer, PIECES)
    with pytest.raises(TransferError) as raised:
        session.finish()
    assert raised.value.code == code and str(error) in str(raised.value)
    assert initiator.written == done == [0]  # nothing is posted after the failure
    assert session.failed


def test_a_failed_gpu_wait_fails_the_transfer(pool, monkeypatch):
    """On a CUDA pool each post first waits for the layer's compute; a CUDA error there must
    surface as the transfer's failure (CPU stand-in for the event)."""
    class _BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(nixl_sender, "_computed_event", lambda pool: _BrokenEvent())
    initiator, done = _Initiator(pool), []
    session = _session(initiator, pool, done)
    session.post_layer(0, PIECES)
    with pytest.raises(TransferError, match="illegal memory access") as raised:
        session.finish()
    assert raised.value.code == ErrorCode.INTERNAL and initiator.written == done == []
