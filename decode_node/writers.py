"""The writers of this node's KV: the transport handshake (GetTransportInfo), and admitting each
writer to its reservation's window (BeginTransfer) until it reports back (CompleteTransfer).

The transport's receiver (common/transports) moves the bytes and fences the window's pages while
the writer may write; what is decided here is who may write where, and what a report changes
in the request's status (decode_node/request_table.py).
"""
from __future__ import annotations

import time

from common.engine.core import Engine
from common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from common.serving.fingerprint import fingerprint_of, mismatch
from common.tracing import Tracer
from common.transports import open_receiver
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences
from decode_node.config import DecodeNodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.request_table import HOLDING_RESERVATION, LiveRequest, RequestTable, Status
from protos.duet.v1 import duet_pb2 as pb


class Writers:
    def __init__(self, config: DecodeNodeConfig, engine: Engine, requests: RequestTable, metrics: DecodeMetrics,
                 tracer: Tracer, name: str) -> None:
        self.engine = engine
        self.lock = engine.lock
        self._requests = requests
        self._metrics = metrics
        self._tracer = tracer
        self.fences = WriteFences(engine.allocator, engine.lock, config.quarantine_seconds)
        self.receiver = open_receiver(config.transport, engine.pool, self.fences, config.host, config.advertise_host,
                                      name=name, transfers_pending=requests.awaiting_transfer)

    def close(self) -> None:
        self.receiver.close()
        self.fences.lift_all()

    def transport_info(self, theirs: pb.CompatibilityFingerprint, transport: str) -> pb.TransportInfo:
        ours = fingerprint_of(self.engine.model, self.engine.pool)
        if (why := mismatch(ours, theirs, "decode node", "prefill node")) is not None:
            raise FailedPrecondition(f"{why}; run both nodes with the same model, dtype and --page-size")
        if transport != self.receiver.transport:
            raise FailedPrecondition(f"this decode node receives KV over {self.receiver.transport!r}, "
                                     f"not {transport!r}: start both nodes with the same --transport")
        info = self.receiver.info()
        info.fingerprint.CopyFrom(ours)
        info.num_slots = self.engine.pool.num_slots
        return info

    def _writer_entry(self, request_id: str, nonce: int) -> LiveRequest:
        """The request the writer of (request_id, nonce) writes for, while it holds its reservation."""
        entry = self._requests.get(request_id)
        if entry is None or entry.status not in HOLDING_RESERVATION:
            raise NotFound(f"no reservation {request_id!r}: it was never made, expired or was aborted")
        if nonce != entry.reservation.nonce:
            raise PermissionDenied(f"transfer_nonce does not match the one issued for {request_id!r}")
        return entry

    def begin(self, request_id: str, nonce: int, metadata: list[int]) -> None:
        with self.lock:
            entry = self._writer_entry(request_id, nonce)
            r = entry.reservation
            if entry.status is Status.RECEIVED:
                raise FailedPrecondition(f"the transfer for {request_id!r} already completed")
            if metadata != r.segments.to_wire():
                raise InvalidArgument(f"kv_append_metadata does not match the slots reserved for {request_id!r}")
            self.receiver.admit(WriteWindow(request_id, nonce, r.segments, tuple(r.seq.held_pages),
                                            alive=lambda: self._requests.holds_reservation(entry)))
            r.transfer_started = time.perf_counter()
            self._requests.move(entry, Status.RECEIVING)
        self._tracer.event(request_id, "transfer_started")

    def complete(self, request_id: str, nonce: int, abandoned: bool = False) -> None:
        """The writer is done: its KV is all here, or (`abandoned`) it gave up and writes nothing
        more. Either way its fence comes down, even when its reservation is already gone."""
        with self.lock:
            lifted = self.receiver.complete(request_id, nonce)
            entry = self._requests.get(request_id)
            if abandoned and lifted and (entry is None or entry.reservation is None
                                         or entry.reservation.nonce != nonce):
                return
            entry = self._writer_entry(request_id, nonce)
            if abandoned:
                self._metrics.transfers.failed("abandoned")
                if entry.status is Status.RECEIVING:  # another writer may begin
                    self._requests.move(entry, Status.RESERVED)
            elif entry.status is not Status.RECEIVED:
                r = entry.reservation
                pool = self.engine.pool
                self._metrics.transfers.completed(r.segments.num_slots * 2 * pool.num_layers * pool.slot_bytes(),
                                                  time.perf_counter() - (r.transfer_started or time.perf_counter()),
                                                  len(r.segments))
                self._requests.move(entry, Status.RECEIVED)
        self._tracer.event(request_id, "transfer_abandoned" if abandoned else "transfer_complete")
