"""gRPC servicer for duet.v1.DecodeNode: protobuf in, DecodeNode calls, protobuf out."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc

from common.engine.generation import Continuation, FinishReason, RequestHandle
from common.engine.guided import GrammarCompiler
from common.engine.sampling import SamplingParams
from common.openai_http.endpoint_metrics import EndpointCounter
from common.openai_http.gateway_routes import PREFILLER_HEADER
from common.serving.grpc_status import answered_with_status, to_grpc
from common.serving.node_rpcs import NodeRpcs
from common.serving.prompts import prompt_token_ids
from common.node_messages import PrefixHolder, SendRequest
from common.serving.rpc_convert import (chunk_to_proto, continuation_from_proto, from_proto, sampling_from_proto,
                                        to_proto)
from decode_node.node import DecodeNode
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)


def _deadline(context: grpc.ServicerContext) -> float:
    """The call's deadline as a time.monotonic() instant (centuries away when the client set none)."""
    return time.monotonic() + context.time_remaining()


def _cancelled(context: grpc.ServicerContext) -> Callable[[], bool]:
    """Whether the client cancelled the call. gRPC also ends a call when its deadline passes, which
    is DEADLINE_EXCEEDED (the waiters check their deadline), not a cancellation."""
    return lambda: not context.is_active() and context.time_remaining() > 0


class DecodeNodeService(NodeRpcs, duet_pb2_grpc.DecodeNodeServicer):
    def __init__(self, node: DecodeNode, draining: threading.Event | None = None,
                 stop: Callable[[], None] = lambda: None) -> None:
        """`stop` shuts the daemon down (after a Drain)."""
        super().__init__(node, draining)
        self._stop = stop
        self.metrics = node.metrics
        self.http_requests = EndpointCounter(node.metrics.registry)
        self.grammars = GrammarCompiler(node.tokenizer, node.vocab_size)

    def _answering(self, context: grpc.ServicerContext, rpc: str):
        """The body's RequestError ends the call with its status, counted by `rpc` and code."""
        return answered_with_status(context, lambda exc: self.metrics.requests.labels(rpc, exc.code.name).inc())

    def PrepareReceive(self, request: pb.PrepareReceiveRequest, context) -> pb.PrepareReceiveResponse:
        end = request.kv_window_end if request.HasField("kv_window_end") else None
        self.node.tracer.event(request.request_id, "received", rpc="PrepareReceive",
                               prompt_tokens=len(request.token_ids))
        with self._answering(context, "PrepareReceive"):
            window = self.node.prepare_receive(request.request_id, request.token_ids, end,
                                               cancelled=_cancelled(context), deadline=_deadline(context))
        return to_proto(window, pb.PrepareReceiveResponse)

    def GetTransportInfo(self, request: pb.GetTransportInfoRequest, context) -> pb.TransportInfo:
        with self._answering(context, "GetTransportInfo"):
            # The handshake is the wire's own: fingerprints and transport descriptors, as protobuf.
            return self.node.writer_gate.transport_info(request.fingerprint, request.transport,
                                                    request.writer if request.HasField("writer") else None)

    def BeginTransfer(self, request: pb.BeginTransferRequest, context) -> pb.BeginTransferResponse:
        with self._answering(context, "BeginTransfer"):
            self.node.begin_transfer(request.request_id, request.transfer_nonce, list(request.kv_append_metadata),
                                     request.writer_incarnation)
        return pb.BeginTransferResponse()

    def CompleteTransfer(self, request: pb.CompleteTransferRequest, context) -> pb.CompleteTransferResponse:
        with self._answering(context, "CompleteTransfer"):
            self.node.complete_transfer(request.request_id, request.transfer_nonce, request.abandoned,
                                        request.kv_checksums)
        return pb.CompleteTransferResponse()

    def StartGeneration(self, request: pb.StartGenerationRequest, context) -> Iterator[pb.GenerationChunk]:
        received = time.perf_counter()
        self.node.tracer.event(request.request_id, "received", rpc="StartGeneration")
        with self._answering(context, "StartGeneration"):
            params = sampling_from_proto(request.sampling, self.node.vocab_size, self.grammars)
            handle = self.node.start_generation(request.request_id, request.kv_window_begin, params,
                                                self._continuation(request, params))
        yield from self._stream("StartGeneration", handle, context, received)

    def Generate(self, request: pb.GenerateRequest, context) -> Iterator[pb.GenerationChunk]:
        received = time.perf_counter()
        rid = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        self.node.tracer.event(rid, "received", rpc="Generate")
        self.http_requests.count(context.invocation_metadata())
        with self._answering(context, "Generate"):
            params = sampling_from_proto(request.sampling, self.node.vocab_size, self.grammars)
            tokens = prompt_token_ids(request, self.node.tokenizer)
            handle = self.node.generate(rid, tokens, params, cancelled=_cancelled(context),
                                        deadline=_deadline(context), continuation=self._continuation(request, params),
                                        prefiller=dict(context.invocation_metadata()).get(PREFILLER_HEADER),
                                        prefix_holder=from_proto(request.prefix_holder, PrefixHolder)
                                        if request.HasField("prefix_holder") else None)
        yield from self._stream("Generate", handle, context, received)

    def _continuation(self, request: pb.GenerateRequest | pb.StartGenerationRequest,
                      params: SamplingParams) -> Continuation | None:
        if not request.HasField("continuation"):
            return None
        return continuation_from_proto(request.continuation, params, self.node.vocab_size)

    def Migrate(self, request: pb.MigrateRequest, context) -> pb.MigrateResponse:
        with self._answering(context, "Migrate"):
            moved = self.node.migrate(request.request_id, request.target_address)
        return to_proto(moved, pb.MigrateResponse)

    def SendPrefix(self, request: pb.RemoteSendRequest, context) -> pb.RemoteSendResponse:
        with self._answering(context, "SendPrefix"):
            sent = self.node.send_prefix(from_proto(request, SendRequest), context.time_remaining())
        self.metrics.requests.labels("SendPrefix", "OK").inc()
        return to_proto(sent, pb.RemoteSendResponse)

    def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        with self._answering(context, "Drain"):
            moved = self.node.drain()
        self._stop()  # relays the migrated streams to their end (drain_before_stop), then exits
        return pb.DrainResponse(requests_migrated=moved)

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        with self._answering(context, "Abort"):
            self.node.abort(request.request_id)
        return pb.AbortResponse()

    def _stream(self, rpc: str, handle: RequestHandle, context, received: float) -> Iterator[pb.GenerationChunk]:
        """Relay chunks until the request finishes (all of its parallel samples). A call
        cancelled at any point (even before this generator first runs, or while gRPC no longer
        pulls it) aborts the request."""
        if not context.add_callback(lambda: self.node.cancel(handle)):
            self.node.cancel(handle)  # the call already ended
        first = None
        samples = 1
        while True:
            chunk = handle.next_chunk(timeout=0.5)
            if chunk is None:
                if not context.is_active():
                    self.node.cancel(handle)
                    self.metrics.requests.labels(rpc, "cancelled").inc()
                    return
                continue
            now = time.perf_counter()
            if first is None and chunk.token_ids:
                first = now
                self.metrics.ttft.observe(now - received)
            if chunk.finish_reason is FinishReason.ERROR:
                self.metrics.requests.labels(rpc, chunk.error_code.name).inc()
                context.abort(to_grpc(chunk.error_code), chunk.error)
            yield chunk_to_proto(handle.request_id, chunk, self.node.tokenizer.token_bytes)
            samples = max(samples, chunk.index + 1)
            if chunk.final:
                per_sample = chunk.usage.completion_tokens / samples  # the samples decode side by side
                if first is not None and per_sample > 1:
                    self.metrics.tpot.observe((now - first) / (per_sample - 1))
                self.metrics.requests.labels(rpc, chunk.finish_reason).inc()
                return
