"""The prefill node's request logic, independent of gRPC."""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.daemon_limits import check_prompt, check_request_id
from common.engine.core import Engine
from common.errors import DeadlineExceeded, InvalidArgument, RequestError, Unavailable
from common.kv.segments import MetadataError, Segments, slot_range
from common.model.llama import LlamaModel
from common.serving.fingerprint import fingerprint_of
from common.serving.incarnation import INCARNATION, writer_identity
from common.serving.pool_metrics import node_load
from common.tracing import Tracer
from common.transports import TransferError, open_sender
from common.transports.checksum import kv_checksums
from prefill_node.config import PrefillNodeConfig
from prefill_node.decode_peers import DecodePeer, DecodePeers
from prefill_node.faults import with_faults
from prefill_node.metrics import PrefillMetrics
from prefill_node.scheduler import PrefillJob, PrefillScheduler
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)


class PrefillNode:
    def __init__(self, config: PrefillNodeConfig, model: LlamaModel) -> None:
        self.config = config
        self.engine = Engine(model, config.kv_pages, config.page_size)
        self.fingerprint = fingerprint_of(model, self.engine.pool)
        self.sender = open_sender(config.transport, self.engine.pool,
                                  name=f"prefill-{config.host}-{config.port}-{uuid.uuid4().hex[:8]}")
        self.identity = writer_identity(config.advertise_address)
        self.peers = DecodePeers(self.fingerprint, self.identity, self.sender, config.tls)
        self.tracer = Tracer(f"prefill {config.advertise_address}", config.trace_requests)
        self.scheduler = PrefillScheduler(self.engine, config.max_batch_tokens, self.tracer)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kv-checksum")  # beside the transfer's wait
        self.metrics = PrefillMetrics(self.engine, self.scheduler)
        self.scheduler.start()

    def shutdown(self) -> None:
        self.scheduler.stop()
        self._hasher.shutdown()
        self.peers.close()
        self.sender.close()

    def load(self) -> pb.NodeLoad:
        with self.engine.lock:
            return node_load(self.engine, running_requests=self.scheduler.num_jobs(),
                             queued_prefill_tokens=self.scheduler.pending_tokens(), incarnation=INCARNATION)

    def _validate(self, req: pb.RemoteSendRequest) -> None:
        check_request_id(req.request_id)
        n, begin, end = len(req.token_ids), req.kv_window_begin, req.kv_window_end
        if not 0 <= begin < end < n:
            raise InvalidArgument(f"need 0 <= kv_window_begin < kv_window_end < len(token_ids); got "
                                  f"begin={begin}, end={end}, {n} tokens")
        cfg = self.engine.model.config
        check_prompt(req.token_ids, cfg.vocab_size, cfg.max_position_embeddings)

    def remote_send(self, req: pb.RemoteSendRequest, timeout_s: float | None) -> pb.RemoteSendResponse:
        """Prefill `token_ids[:end]` and push K/V of `[begin, end)` into the decode node's slots.

        The whole call (prefill and transfer) is bounded by --transfer-timeout-seconds, and by the
        caller's deadline `timeout_s` when that is sooner: the decode node's lease bounds the
        hand-off anyway, so the two should agree."""
        self.tracer.event(req.request_id, "received", rpc="RemoteSend", prompt_tokens=len(req.token_ids),
                          kv_window_begin=req.kv_window_begin, kv_window_end=req.kv_window_end)
        self._validate(req)
        begin, end = req.kv_window_begin, req.kv_window_end
        metadata = list(req.kv_append_metadata)
        try:  # shape first, before contacting anyone
            Segments.from_wire(metadata, end - begin, num_slots=2**62)
        except MetadataError as exc:
            raise InvalidArgument(f"kv_append_metadata: {exc}") from None
        timeout_s = min(timeout_s or self.config.transfer_timeout_seconds, self.config.transfer_timeout_seconds)
        deadline = time.monotonic() + timeout_s
        peer = self.peers.get(req.decode_address)
        try:
            dst = Segments.from_wire(metadata, end - begin, num_slots=peer.info.num_slots)
        except MetadataError as exc:
            raise InvalidArgument(f"kv_append_metadata does not fit decode node {req.decode_address}: {exc}") from None
        started = time.perf_counter()
        # Before any byte moves: NIXL writes land wherever they are aimed.
        self._call(peer, peer.stub.BeginTransfer, pb.BeginTransferRequest(
            request_id=req.request_id, transfer_nonce=req.transfer_nonce, kv_append_metadata=metadata,
            writer_incarnation=INCARNATION), deadline)
        self.tracer.event(req.request_id, "transfer_started", decode=req.decode_address)
        try:
            session = with_faults(self.sender.open(
                req.decode_address, req.request_id, req.transfer_nonce, timeout_s,
                on_layer_done=lambda layer: self.tracer.event(req.request_id, "transfer_layer_done", layer=layer)),
                self.engine.pool)
        except TransferError as exc:
            self.peers.drop(req.decode_address)
            self.metrics.transfers.failed("unavailable")
            raise Unavailable(str(exc)) from None
        with self.engine.lock:
            seq = self.engine.new_sequence(req.request_id, list(req.token_ids[:end]))
        job = PrefillJob(seq, begin, dst, session)
        cached = seq.num_computed
        self.metrics.prefix_hit_tokens.inc(cached)
        self.tracer.event(req.request_id, "prefix_matched", matched_tokens=cached, prompt_tokens=end)
        self.scheduler.submit(job)
        ok = False
        try:
            if not job.prefilled.wait(max(0.0, deadline - time.monotonic())):
                raise DeadlineExceeded(f"prefill of {end} tokens did not finish within {timeout_s:.1f}s")
            if job.error is not None:
                raise job.error
            prefilled = time.perf_counter()
            self.tracer.event(req.request_id, "prefilled", computed_tokens=end - cached)
            self._finish_transfer(req, peer, job, deadline)
            ok = True
        except BaseException as exc:
            self.metrics.transfers.failed(exc.code.name.lower() if isinstance(exc, RequestError) else "internal")
            raise
        finally:
            if not ok and session.cancel() and self.sender.one_sided:
                self._abandon(req, peer)
            self.scheduler.release(job, cache=ok)
        done = time.perf_counter()
        self.metrics.observe(end - cached, prefilled - started, done - started)
        pool = self.engine.pool
        nbytes = (end - begin) * 2 * pool.num_layers * pool.slot_bytes()
        self.metrics.transfers.completed(nbytes, done - (job.first_posted or prefilled), len(dst))
        return pb.RemoteSendResponse(
            tokens_sent=end - begin, tokens_computed=end - cached,
            bytes_sent=nbytes,
            prefill_seconds=prefilled - started, transfer_seconds=done - started,
        )

    def _call(self, peer: DecodePeer, rpc, request, deadline: float) -> None:
        """One control-plane call to the decode node, within the transfer's deadline; a node
        that is gone is forgotten, so the next request re-handshakes."""
        try:
            rpc(request, timeout=max(0.1, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.peers.drop(peer.address)
            raise RequestError.from_rpc(exc, f"decode node {peer.address}") from None

    def _abandon(self, req: pb.RemoteSendRequest, peer: DecodePeer) -> None:
        """Tell the decode node that this failed transfer will write nothing more, so it can
        reuse the pages at once instead of holding them until its --quarantine-seconds pass.
        Best effort: when the decode node is unreachable, the quarantine ends it. A peer dropped
        on the way (a failed transfer forgets its endpoint) is told over a channel of its own."""
        report = pb.CompleteTransferRequest(request_id=req.request_id, transfer_nonce=req.transfer_nonce,
                                            abandoned=True)
        try:
            try:
                peer.stub.CompleteTransfer(report, timeout=2.0)
            except ValueError:  # the peer was dropped, its channel closed
                with self.config.tls.channel(req.decode_address) as channel:
                    duet_pb2_grpc.DecodeNodeStub(channel).CompleteTransfer(report, timeout=2.0)
        except grpc.RpcError as exc:
            log.info("could not report an abandoned transfer", extra={"fields": {
                "request_id": req.request_id, "error": str(exc)}})

    def _finish_transfer(self, req: pb.RemoteSendRequest, peer: DecodePeer, job: PrefillJob, deadline: float) -> None:
        """Wait for every byte to land, then tell the decode node (request id + nonce, and the
        KV's checksums when it verifies them: computed meanwhile, from this node's pool)."""
        checksums = None
        if peer.info.verify_kv:
            slots = slot_range(job.seq.pages, self.engine.page_size, job.begin, job.end)
            checksums = self._hasher.submit(kv_checksums, self.engine.pool, slots)
        try:
            with self.tracer.span(req.request_id, "transfer_finished", tokens=req.kv_window_end - req.kv_window_begin):
                job.session.finish()
        except TransferError as exc:
            if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or exc.in_flight:
                # A dead or stalled peer: forget its endpoint, so the next request re-handshakes
                # instead of reusing a connection that may still carry this transfer's bytes.
                self.peers.drop(req.decode_address)
            raise RequestError(str(exc), exc.code) from None
        self._call(peer, peer.stub.CompleteTransfer, pb.CompleteTransferRequest(
            request_id=req.request_id, transfer_nonce=req.transfer_nonce,
            kv_checksums=checksums.result() if checksums else ()), deadline)
        self.tracer.event(req.request_id, "completion_sent")
