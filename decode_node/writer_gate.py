"""The gate the writers of this node's KV pass (`WriterGate`): the transport handshake (GetTransportInfo), and admitting each
writer to its reservation's window (BeginTransfer) until it reports back (CompleteTransfer).

Each writer announces its run (`pb.WriterIdentity`) in the handshake. A fence of a writer that
never reported back comes down as soon as there is proof that its run is over: the same address
announced a new incarnation (in a handshake or its GetLoad), or its process is gone from this
host; without proof it waits out --quarantine-seconds (common/transports/fences.py).

The transport's receiver (common/transports) moves the bytes and fences the window's pages while
the writer may write; what is decided here is who may write where, and what a report changes
in the request's status (decode_node/request_table.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

from common.engine.attention_window import layer_skips
from common.engine.core import Engine
from common.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from common.kv.segments import RELEASED
from common.serving.fingerprint import fingerprint_of, mismatch
from common.serving.incarnation import provably_gone
from common.tracing import Tracer
from common.transports import open_receiver
from common.transports.checksum import first_mismatch, kv_checksums
from common.transports.connector import WriteWindow
from common.transports.layer_slots import receiver_layer_slots
from common.transports.pieces import transfer_bytes
from common.transports.fences import WriteFences
from common.transports.metrics import TransferFailure
from decode_node.config import DecodeNodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.request_table import HOLDING_RESERVATION, LiveRequest, RequestTable, Reservation, Status
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)


class WriterGate:
    def __init__(self, config: DecodeNodeConfig, engine: Engine, requests: RequestTable, metrics: DecodeMetrics,
                 tracer: Tracer, name: str) -> None:
        self.engine = engine
        self.lock = engine.lock
        self.verify_kv = config.verify_kv == "on"
        self._requests = requests
        self._metrics = metrics
        self._tracer = tracer
        self.fences = WriteFences(engine.allocator, engine.lock, config.quarantine_seconds, engine.sliding)
        # One thread checks KV: torch's OpenMP gives every thread that runs a parallel op a team of
        # its own, so checking on each gRPC worker would grow a team per worker.
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kv-verify")
        self._runs: dict[int, pb.WriterIdentity] = {}  # incarnation -> the run it names
        self._run_at: dict[str, int] = {}  # writer address -> its latest incarnation
        self.receiver = open_receiver(config.transport, engine.pool, self.fences, config.host, config.advertise_host,
                                      name=name, transfers_pending=requests.awaiting_transfer)

    def close(self) -> None:
        self._checker.shutdown()
        self.receiver.close()
        self.fences.lift_all()

    def transport_info(self, theirs: pb.CompatibilityFingerprint, transport: str,
                       writer: pb.WriterIdentity | None = None) -> pb.TransportInfo:
        ours = fingerprint_of(self.engine.model, self.engine.pool)
        if (why := mismatch(ours, theirs, "decode node", "prefill node")) is not None:
            raise FailedPrecondition(f"{why}; run both nodes with the same model, dtype and --page-size")
        if transport != self.receiver.transport:
            raise FailedPrecondition(f"this decode node receives KV over {self.receiver.transport!r}, "
                                     f"not {transport!r}: start both nodes with the same --transport")
        info = self.receiver.info()
        info.fingerprint.CopyFrom(ours)
        info.num_slots = self.engine.pool.num_slots
        info.sliding_slots = self.engine.pool.sliding_slots
        info.verify_kv = self.verify_kv
        if writer is not None and writer.incarnation:
            self.seen_run(writer.address, writer.incarnation, writer)
        return info

    def seen_run(self, address: str, incarnation: int, writer: pb.WriterIdentity | None = None) -> None:
        """The writer at `address` runs as `incarnation` (its handshake, or its GetLoad): an
        earlier run there is over, and its fences come down. Incarnation 0 (a writer that does
        not say) proves nothing."""
        if not incarnation:
            return
        with self.lock:
            earlier = self._run_at.get(address)
            if writer is not None:
                self._runs[incarnation] = writer
                self._run_at[address] = incarnation
            elif earlier is None:
                return  # it never wrote here
            if earlier is not None and earlier != incarnation:
                self._run_at[address] = incarnation
                self._runs.pop(earlier, None)
                self._lift(earlier, f"{address} restarted")

    def lift_gone_runs(self) -> None:
        """Lift the fences of quarantined writer runs whose process is gone from this host."""
        for run in self.fences.quarantined_writers():
            writer = self._runs.get(run)
            if writer is not None and provably_gone(writer):
                self._lift(run, f"{writer.address}'s process {writer.pid} is gone")

    def _lift(self, run: int, proof: str) -> None:
        if pages := self.fences.lift_writer_run(run):
            log.info("write fences lifted: their writer's run is over", extra={"fields": {
                "pages": pages, "proof": proof}})

    def _writer_entry(self, request_id: str, nonce: int) -> LiveRequest:
        """The request the writer of (request_id, nonce) writes for, while it holds its reservation."""
        entry = self._requests.get(request_id)
        if entry is None or entry.status not in HOLDING_RESERVATION:
            raise NotFound(f"no reservation {request_id!r}: it was never made, expired or was aborted")
        if nonce != entry.reservation.nonce:
            raise PermissionDenied(f"transfer_nonce does not match the one issued for {request_id!r}")
        return entry

    def begin(self, request_id: str, nonce: int, metadata: list[int], writer: int = 0) -> None:
        with self.lock:
            entry = self._writer_entry(request_id, nonce)
            r = entry.reservation
            if entry.status is Status.RECEIVED:
                raise FailedPrecondition(f"the transfer for {request_id!r} already completed")
            if metadata != r.placement.to_wire():
                raise InvalidArgument(f"kv_append_metadata does not match the slots reserved for {request_id!r}")
            seq = r.seq
            windowed = tuple(p for p in seq.pages[seq.sliding_from : seq.sliding_to] if p != RELEASED)
            self.receiver.admit(WriteWindow(request_id, nonce, r.placement, tuple(seq.held_pages),
                                            alive=lambda: self._requests.holds_reservation(entry), writer=writer,
                                            windowed=windowed if self.engine.sliding else ()))
            r.transfer_started = time.perf_counter()
            self._requests.move(entry, Status.RECEIVING)
        self._tracer.event(request_id, "transfer_started")

    def complete(self, request_id: str, nonce: int, abandoned: bool = False, checksums: Seq[int] = ()) -> None:
        """The writer is done: its KV is all here, or (`abandoned`) it gave up and writes nothing
        more. Either way its fence comes down, even when its reservation is already gone. With
        --verify-kv the KV must match the writer's `checksums` before the request may generate."""
        with self.lock:
            lifted = self.receiver.complete(request_id, nonce)
            entry = self._requests.get(request_id)
            if abandoned and lifted and (entry is None or entry.reservation is None
                                         or entry.reservation.nonce != nonce):
                return
            entry = self._writer_entry(request_id, nonce)
            if abandoned:
                self._metrics.transfers.failed(TransferFailure.ABANDONED)
                if entry.status is Status.RECEIVING:  # another writer may begin
                    self._requests.move(entry, Status.RESERVED)
            if abandoned or entry.status is Status.RECEIVED:
                self._tracer.event(request_id, "transfer_abandoned" if abandoned else "transfer_complete")
                return
        r = entry.reservation
        if self.verify_kv:  # outside the lock: the reservation holds the pages, and nothing writes them now
            self._verify(entry, checksums)
        with self.lock:
            if not self._requests.holds_reservation(entry):
                raise NotFound(f"no reservation {request_id!r}: it expired or was aborted during CompleteTransfer")
            if entry.status is not Status.RECEIVED:
                nbytes = transfer_bytes(self.engine.pool, r.placement.full.num_slots, self._skips(r))
                self._metrics.transfers.completed(nbytes,
                                                  time.perf_counter() - (r.transfer_started or time.perf_counter()),
                                                  len(r.placement.full))
                self._requests.move(entry, Status.RECEIVED)
        self._tracer.event(request_id, "transfer_complete")

    def _skips(self, r: Reservation) -> tuple[int, ...]:
        """Per layer, the leading positions of the reservation its writer does not move."""
        return layer_skips(self.engine.model.config, r.begin, r.end)

    def _verify(self, entry: LiveRequest, checksums: Seq[int]) -> None:
        """Raise DataLoss, putting the reservation back to wait for a writer, unless the slots
        hold what the writer says it sent."""
        if not checksums:
            raise InvalidArgument("kv_checksums are missing: this decode node verifies received KV (--verify-kv on)")
        r = entry.reservation
        slots = receiver_layer_slots(r.placement, self._skips(r), self.engine.model.sliding_layers)
        ours = self._checker.submit(kv_checksums, self.engine.pool, slots).result()
        where = first_mismatch(ours, list(checksums))
        if where is None:
            return
        self._metrics.transfers.failed(TransferFailure.CHECKSUM)
        self._tracer.event(entry.request_id, "transfer_corrupt", first_mismatch=where)
        with self.lock:
            if self._requests.holds_reservation(entry) and entry.status is Status.RECEIVING:
                self._requests.move(entry, Status.RESERVED)
        raise DataLoss(f"the KV received for {entry.request_id!r} does not match the writer's checksums (first at "
                       f"{where}); it was discarded: push it again, or prefill locally")
