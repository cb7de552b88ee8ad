"""The prefill node's request logic, independent of gRPC (common/node_messages.py in and out)."""
from __future__ import annotations

import time
import uuid

import numpy as np

from common.engine.attention_window import layer_skips
from common.engine.core import Engine
from common.errors import DeadlineExceeded, ErrorCode, RequestError
from common.kv.segments import Segments, slot_range
from common.model.decoder import DecoderModel
from common.node_messages import NodeLoad, SendRequest, SendResult
from common.peers.kv_writer import KvWriter, OpenTransfer, check_send_request
from common.serving.fingerprint import fingerprint_of
from common.serving.incarnation import INCARNATION
from common.serving.kv_tiers import KvTiers
from common.serving.pool_metrics import node_load
from common.tracing import Tracer
from common.transports import open_sender
from common.transports.pieces import transfer_bytes
from prefill_node.config import PrefillNodeConfig
from prefill_node.faults import with_faults
from prefill_node.metrics import PrefillMetrics
from prefill_node.scheduler import PrefillJob, PrefillScheduler


class PrefillNode:
    def __init__(self, config: PrefillNodeConfig, model: DecoderModel) -> None:
        self.config = config
        self.engine = Engine(model, config.kv_pages, config.page_size, config.sliding_pages)
        self.fingerprint = fingerprint_of(model, self.engine.pool)
        sender = open_sender(config.transport, self.engine.pool,
                             name=f"prefill-{config.host}-{config.port}-{uuid.uuid4().hex[:8]}")
        self.writer = KvWriter(self.engine, sender, self.fingerprint, config.advertise_address, config.tls)
        self.tracer = Tracer(f"prefill {config.advertise_address}", config.trace_requests)
        self.scheduler = PrefillScheduler(self.engine, config.max_batch_tokens, self.tracer,
                                          adaptive_threads=config.threads is None)
        self.metrics = PrefillMetrics(self.engine, self.scheduler)
        self.tiers = KvTiers(config, self.engine, self.tracer, self.metrics.registry)
        self.scheduler.start()

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.tiers.close()
        self.writer.close()

    def load(self) -> NodeLoad:
        with self.engine.lock:
            return node_load(self.engine, running_requests=self.scheduler.num_jobs(),
                             queued_prefill_tokens=self.scheduler.pending_tokens(), incarnation=INCARNATION)

    def remote_send(self, req: SendRequest, timeout_s: float | None) -> SendResult:
        """Prefill `token_ids[:end]` and push K/V of `[begin, end)` into the decode node's slots.

        The whole call (prefill and transfer) is bounded by --transfer-timeout-seconds, and by the
        caller's deadline `timeout_s` when that is sooner: the decode node's lease bounds the
        hand-off anyway, so the two should agree."""
        self.tracer.event(req.request_id, "received", rpc="RemoteSend", prompt_tokens=len(req.token_ids),
                          kv_window_begin=req.kv_window_begin, kv_window_end=req.kv_window_end)
        metadata = check_send_request(req, self.engine.model)
        begin, end = req.kv_window_begin, req.kv_window_end
        timeout_s = min(timeout_s or self.config.transfer_timeout_seconds, self.config.transfer_timeout_seconds)
        deadline = time.monotonic() + timeout_s
        peer = self.writer.peers.get(req.decode_address)
        dst = self.writer.destination(peer, metadata, begin, end)
        started = time.perf_counter()
        read_back = self.tiers.read_back(req.request_id, req.token_ids[: end - 1], deadline)
        began = False
        try:  # before any byte moves (BeginTransfer): NIXL writes land wherever they are aimed
            with self.writer.transfer(
                    peer, req.request_id, req.transfer_nonce, metadata, deadline,
                    on_layer_done=lambda layer: self.tracer.event(req.request_id, "transfer_layer_done",
                                                                  layer=layer)) as transfer:
                began = True
                return self._prefill_into(req, transfer, dst, read_back.tokens, started, deadline, timeout_s)
        except BaseException as exc:
            code = exc.code if isinstance(exc, RequestError) else None
            if began or code is ErrorCode.UNAVAILABLE:  # UNAVAILABLE: admitted, or gone, as it began
                self.metrics.transfers.failed_with(code)
            raise

    def _prefill_into(self, req: SendRequest, transfer: OpenTransfer, dst: list[np.ndarray], read_back_tokens: int,
                      started: float, deadline: float, timeout_s: float) -> SendResult:
        """Compute the window's KV, its layers posted as the forward finishes each, and finish the
        transfer; the pages go back into the prefix cache once it landed."""
        begin, end = req.kv_window_begin, req.kv_window_end
        self.tracer.event(req.request_id, "transfer_started", decode=req.decode_address)
        transfer.transfer = with_faults(transfer.transfer, self.engine.pool)
        with self.engine.lock:
            seq = self.engine.new_sequence(req.request_id, list(req.token_ids[:end]), length=len(req.token_ids))
        skips = layer_skips(self.engine.model.config, begin, end)
        job = PrefillJob(seq, begin, dst, transfer.transfer, skips)
        cached = seq.num_computed
        self.tiers.served(end, cached, read_back_tokens)
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
            with self.tracer.span(req.request_id, "transfer_finished", tokens=end - begin):
                with self.engine.lock:  # the sliding group's window of the end is held until released
                    src = self.writer.source(slot_range(seq.pages, self.engine.page_size, begin, end), skips)
                self.writer.finish(transfer, src, deadline)
            self.tracer.event(req.request_id, "completion_sent")
            ok = True
        finally:
            self.scheduler.release(job, cache=ok)
        done = time.perf_counter()
        self.metrics.observe(end - cached, prefilled - started, done - started)
        nbytes = transfer_bytes(self.engine.pool, end - begin, skips)
        segments = len(Segments.of_slots(max(dst, key=len)))  # of the window's every position
        self.metrics.transfers.completed(nbytes, done - (job.first_posted or prefilled), segments)
        return SendResult(tokens_sent=end - begin, tokens_computed=end - cached, bytes_sent=nbytes,
                          prefill_seconds=prefilled - started, transfer_seconds=done - started)
