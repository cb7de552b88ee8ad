"""The sending half of the NIXL transport: this node's pool registered once, and both pools
described once, page by page for every (layer, K|V), as NIXL prepared descriptor lists (this
node's at start, each peer's when it connects). A layer's whole pages then move as ONE prepared
NIXL WRITE naming page indices (numpy, built from a per-transfer plan: nothing per layer grows
with the pages as Python objects); NIXL merges pages adjacent on both sides, so a contiguous
reservation moves as a few large writes. A piece's ends off page boundaries (a partial first or
last page) go in a second, small WRITE of explicit ranges.

Posting runs on a sender thread, not the forward thread: with UCX shared memory the copy
happens inside the post, and it should overlap the next layers' compute. On a CUDA pool the
forward only queues a layer's kernels, so each layer's post first waits for a CUDA event
recorded when the layer was handed over (the layer's K/V are then really in the pool).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import ErrorCode
from common.kv.pool import KVPool, PoolLayout
from common.transports import TransferError
from common.transports.nixl.initiator import NixlInitiator, WriteHandle
from common.transports.pieces import PagePlan, Piece, layer_byte_ranges, plan_pages
from common.transports.sender_thread import SenderThread
from protos.duet.v1 import duet_pb2 as pb


@dataclass(frozen=True)
class _Peer:
    agent_name: str
    base_address: int
    layout: PoolLayout  # where each (layer, K|V) plane lies in its registered region


class NixlTransfer(SenderThread):
    """One transfer: the sender thread posts each queued layer as prepared NIXL WRITEs."""

    def __init__(self, initiator: NixlInitiator, pool: KVPool, peer: _Peer, timeout_s: float,
                 on_layer_done: Callable[[int], None]) -> None:
        self._initiator, self._peer = initiator, peer
        self._handles: list[tuple[int, WriteHandle | None]] = []  # posted, not seen DONE; None ends a layer
        self._plans: dict[int, tuple[list[Piece], PagePlan]] = {}  # by id() of a posted piece list
        self.posting_cpu_s = 0.0  # CPU time the sender thread spent posting (the copy, with UCX sm)
        self._device_set = not pool.storage.is_cuda  # UCX's CUDA transports use the calling thread's device
        super().__init__(pool, timeout_s, on_layer_done, name="nixl-post")

    def post_layer(self, layer: int, pieces: list[Piece]) -> None:
        if pieces:
            self._queue.put((layer, pieces, _computed_event(self._pool)))

    def _take(self, item: tuple[int, list[Piece], torch.cuda.Event | None]) -> None:
        if not self._device_set:
            self._device_set = True
            self._guarded(lambda: torch.cuda.set_device(self._pool.device))
        if self._error is None:
            self._guarded(lambda: self._post(*item))

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except TransferError as exc:
            self._error = self._error or exc
        except Exception as exc:
            self._error = self._error or TransferError(f"posting the KV writes failed: {type(exc).__name__}: {exc}",
                                                       ErrorCode.INTERNAL)

    def _plan(self, pieces: list[Piece]) -> PagePlan:
        """The page plan of a piece list, made once: the scheduler posts one list for every layer."""
        known = self._plans.get(id(pieces))
        if known is None or known[0] is not pieces:
            known = self._plans[id(pieces)] = (pieces, plan_pages(pieces, self._pool.page_size))
        return known[1]

    def _post(self, layer: int, pieces: list[Piece], computed: torch.cuda.Event | None) -> None:
        started = time.thread_time()
        pool, peer = self._pool, self._peer
        sb = pool.slot_bytes()
        if computed is not None:
            computed.synchronize()
        plan = self._plan(pieces)
        ours = pool.layout
        if len(plan.src_pages):
            local = np.concatenate([ours.block_index(layer, kv, plan.src_pages) for kv in (0, 1)])
            remote = np.concatenate([peer.layout.block_index(layer, kv, plan.dst_pages) for kv in (0, 1)])
            nbytes = len(local) * pool.page_size * sb
            self._handles.append((layer, self._initiator.write_blocks(peer.agent_name, local, remote, nbytes)))
        if plan.edges:
            local_ranges = layer_byte_ranges(pool, layer, [(p.src_slot, p.num_slots) for p in plan.edges])
            remote_ranges = [(peer.base_address + peer.layout.offset(layer, kv, p.dst_slot), p.num_slots * sb)
                             for kv in (0, 1) for p in plan.edges]
            self._handles.append((layer, self._initiator.write(peer.agent_name, local_ranges, remote_ranges)))
        self._handles.append((layer, None))
        self.posting_cpu_s += time.thread_time() - started
        self._report_done()

    def _report_done(self) -> None:
        """Report the layers whose writes completed by now (in order; later ones wait)."""
        while self._handles and (self._handles[0][1] is None or self._initiator.is_done(self._handles[0][1])):
            self._finish_write(*self._handles.pop(0))

    def _finish_write(self, layer: int, handle: WriteHandle | None) -> None:
        """Wait for one write; the layer's end marker (None) reports it done if all went well."""
        if handle is None:
            if self._error is None:
                self._on_layer_done(layer)
            return
        try:
            self._initiator.wait(handle, self._remaining())
        except TransferError as exc:
            self._error = self._error or exc

    def finish(self) -> None:
        """Wait until every posted write is DONE (or failed); raises TransferError. Idempotent."""
        self._stop()
        while self._handles:
            self._finish_write(*self._handles.pop(0))
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        """Wait out what was posted (until the deadline); True unless a write may still land."""
        try:
            self.finish()
        except TransferError as exc:
            return not exc.in_flight
        return True


def _computed_event(pool: KVPool) -> torch.cuda.Event | None:
    """On a CUDA pool, an event that completes once the work queued so far (this layer's K/V
    writes) has run; None on the CPU, where the forward is synchronous."""
    if not pool.storage.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(pool.device))
    return event


class NixlSender:
    transport = "nixl"
    one_sided = True

    def __init__(self, pool: KVPool, name: str) -> None:
        self._pool = pool
        self._initiator = NixlInitiator(name, pool.storage)
        self._initiator.prepare_local(pool.layout.page_blocks(pool.storage.data_ptr()))
        self._peers: dict[str, _Peer] = {}

    def connect(self, peer: str, info: pb.TransportInfo) -> None:
        layout = self._pool.layout.with_slots(info.num_slots, info.sliding_slots)
        expected = layout.size_bytes
        if info.pool_size_bytes != expected:
            raise TransferError(f"peer {peer} registered {info.pool_size_bytes} bytes, expected {expected}",
                                ErrorCode.FAILED_PRECONDITION)
        if info.num_slots % self._pool.page_size:
            raise TransferError(f"peer {peer} has {info.num_slots} slots, not whole "
                                f"{self._pool.page_size}-slot pages", ErrorCode.FAILED_PRECONDITION)
        self._initiator.connect(info.nixl_agent_name, info.nixl_agent_metadata)
        self._initiator.prepare_remote(info.nixl_agent_name, layout.page_blocks(info.pool_base_address))
        self._peers[peer] = _Peer(info.nixl_agent_name, info.pool_base_address, layout)

    def disconnect(self, peer: str) -> None:
        known = self._peers.pop(peer, None)
        if known is not None:
            self._initiator.disconnect(known.agent_name)

    def open(self, peer: str, request_id: str, nonce: int, timeout_s: float,
             on_layer_done: Callable[[int], None] = lambda layer: None) -> NixlTransfer:
        return NixlTransfer(self._initiator, self._pool, self._peers[peer], timeout_s, on_layer_done)

    def close(self) -> None:
        self._initiator.close()
