"""gRPC servicer for duet.v1.PrefillNode."""
from __future__ import annotations

from common.errors import RequestError
from common.serving.node_rpcs import NodeRpcs
from prefill_node.node import PrefillNode
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc


class PrefillNodeService(NodeRpcs, duet_pb2_grpc.PrefillNodeServicer):
    node: PrefillNode

    def RemoteSend(self, request: pb.RemoteSendRequest, context) -> pb.RemoteSendResponse:
        try:
            response = self.node.remote_send(request, context.time_remaining())
        except RequestError as exc:
            self.node.metrics.requests.labels("RemoteSend", exc.code.name).inc()
            self.node.tracer.event(request.request_id, "failed", code=exc.code.name, error=str(exc))
            context.abort(exc.code, str(exc))
        self.node.metrics.requests.labels("RemoteSend", "OK").inc()
        return response

