"""The TCP transport's receiver: bytes land in exactly the admitted window's slots; anything else is refused.

Each test runs three times: reading and writing the pool in place (a pool in host memory, long
runs), staged through host buffers, the path of a pool in GPU memory (here on the CPU: gather,
staging copies and offsets are the same; pinning and the CUDA event are what only a GPU adds),
and a host pool's short runs (gathered into one buffer, received into one and scattered)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from common.errors import ErrorCode
from common.kv.page_allocator import PageAllocator
from common.kv.pool import KVPool
from common.kv.segments import Placement, Segments
from common.transports import TransferError
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences
from common.transports.pieces import Piece
from common.transports.tcp import wire
from common.transports.tcp.receiver import TcpReceiver
from common.transports.tcp.sender import TcpTransfer


@pytest.fixture(autouse=True, params=["in-place", "staged", "short-runs"])
def staged(request, monkeypatch) -> bool:
    monkeypatch.setattr(wire, "through_host", lambda pool: request.param == "staged")
    if request.param == "in-place":  # these runs are short: send and receive them in place all the same
        monkeypatch.setattr(wire, "STAGE_BELOW", 0)
    return request.param == "staged"


def _pools():
    src = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4)
    src.data.copy_(torch.randn_like(src.data))
    return src, KVPool(num_layers=3, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4)


def _receiver(dst: KVPool, segments) -> tuple[TcpReceiver, PageAllocator]:
    """A receiver with window ("r", 7) of `segments` admitted (on every page of `dst`), and the
    allocator whose reference counts show its fence: 2 while a connection writes, else 1."""
    allocator = PageAllocator(dst.num_pages)
    pages = allocator.allocate(dst.num_pages)
    receiver = TcpReceiver(dst, WriteFences(allocator, threading.RLock(), quarantine_seconds=60))
    receiver.admit(WriteWindow("r", 7, Placement(Segments(tuple(segments))), tuple(pages), alive=lambda: True))
    return receiver, allocator


def test_pieces_land_in_the_granted_slots():
    src, dst = _pools()
    receiver, allocator = _receiver(dst, [(20, 5), (4, 3)])
    try:
        pieces = [Piece(0, 20, 5), Piece(9, 4, 3)]
        session = TcpTransfer(receiver.address, src, "r", 7)
        for layer in range(3):
            session.post_layer(layer, pieces)
        session.finish()
        for p in pieces:
            assert torch.equal(dst.data[:, :, p.dst_slot : p.dst_slot + p.num_slots],
                               src.data[:, :, p.src_slot : p.src_slot + p.num_slots])
        untouched = torch.ones(dst.num_slots, dtype=torch.bool)
        untouched[20:25] = untouched[4:7] = False
        assert not dst.data[:, :, untouched].any()
        # The fence is lifted once the writer is done (by the receiver, just after its reply).
        deadline = time.monotonic() + 5
        while allocator.refcount(0) != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert {allocator.refcount(p) for p in range(dst.num_pages)} == {1}
    finally:
        receiver.close()


@pytest.mark.parametrize("request_id, nonce, pieces, code", [
    ("q", 7, [Piece(0, 20, 5)], ErrorCode.NOT_FOUND),
    ("r", 8, [Piece(0, 20, 5)], ErrorCode.PERMISSION_DENIED),  # not the window's nonce
    ("r", 7, [Piece(0, 21, 5)], ErrorCode.PERMISSION_DENIED),  # one slot past the grant
    ("r", 7, [Piece(0, 2, 3)], ErrorCode.PERMISSION_DENIED),
])
def test_writes_outside_the_grant_are_refused(request_id, nonce, pieces, code):
    src, dst = _pools()
    receiver, _ = _receiver(dst, [(20, 5), (4, 3)])
    try:
        session = TcpTransfer(receiver.address, src, request_id, nonce)
        session.post_layer(0, pieces)
        with pytest.raises(TransferError) as info:
            session.finish()
        assert info.value.code == code
        assert not dst.data[:, :, :2].any() and not dst.data[:, :, 25:].any()
    finally:
        receiver.close()


def test_unreachable_receiver_is_unavailable():
    src, _ = _pools()
    with pytest.raises(TransferError) as info:
        TcpTransfer("127.0.0.1:1", src, "r", 7)
    assert info.value.code == ErrorCode.UNAVAILABLE


def test_a_failed_device_copy_fails_the_transfer(monkeypatch):
    """On a GPU pool the sender thread first waits for the layer's copy to host; a CUDA error
    there must fail the transfer, not kill the thread."""
    def broken_copy():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(wire, "through_host", lambda pool: True)
    monkeypatch.setattr(wire, "stage_on_host", lambda pool, layer, pieces: (torch.ones(2, 5, 2, 4), broken_copy))
    src, dst = _pools()
    receiver, _ = _receiver(dst, [(20, 5)])
    try:
        session = TcpTransfer(receiver.address, src, "r", 7, timeout_s=5)
        session.post_layer(0, [Piece(0, 20, 5)])
        with pytest.raises(TransferError, match="illegal memory access"):
            session.finish()
        assert session.failed and not dst.data.any()
    finally:
        receiver.close()


def test_frames_of_changing_sizes_land_exactly():
    """Each layer sends a different set of runs (larger, then smaller): reused staging buffers
    must not misplace rows."""
    src, dst = _pools()
    segments = [(0, 8), (12, 4), (20, 8)]
    receiver, _ = _receiver(dst, segments)
    try:
        per_layer = [[Piece(0, 0, 8), Piece(9, 12, 4), Piece(16, 20, 8)], [Piece(4, 20, 3)], [Piece(1, 1, 6)]]
        session = TcpTransfer(receiver.address, src, "r", 7)
        for layer, pieces in enumerate(per_layer):
            session.post_layer(layer, pieces)
        session.finish()
        for layer, pieces in enumerate(per_layer):
            for p in pieces:
                assert torch.equal(dst.data[layer, :, p.dst_slot : p.dst_slot + p.num_slots],
                                   src.data[layer, :, p.src_slot : p.src_slot + p.num_slots])
    finally:
        receiver.close()
