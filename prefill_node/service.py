"""gRPC servicer for duet.v1.PrefillNode."""
from __future__ import annotations

import threading
from collections.abc import Iterator

from common.errors import RequestError
from common.serving.kv_event_stream import KvEventStreams
from prefill_node.node import PrefillNode
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc


class PrefillNodeService(duet_pb2_grpc.PrefillNodeServicer):
    def __init__(self, node: PrefillNode, draining: threading.Event | None = None) -> None:
        self.node = node
        self.kv_events = KvEventStreams(node.engine.kv_events, draining or threading.Event())

    def RemoteSend(self, request: pb.RemoteSendRequest, context) -> pb.RemoteSendResponse:
        try:
            response = self.node.remote_send(request, context.time_remaining())
        except RequestError as exc:
            self.node.metrics.requests.labels("RemoteSend", exc.code.name).inc()
            self.node.tracer.event(request.request_id, "failed", code=exc.code.name, error=str(exc))
            context.abort(exc.code, str(exc))
        self.node.metrics.requests.labels("RemoteSend", "OK").inc()
        return response

    def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.NodeLoad:
        return self.node.load()

    def GetTrace(self, request: pb.GetTraceRequest, context) -> pb.Trace:
        return self.node.tracer.trace(request.request_ids)

    def WatchKvEvents(self, request: pb.WatchKvEventsRequest, context) -> Iterator[pb.KvEvent]:
        yield from self.kv_events.watch(request, context)
