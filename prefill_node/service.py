"""gRPC servicer for duet.v1.PrefillNode."""
from __future__ import annotations

from common.errors import RequestError
from common.node_messages import SendRequest
from common.serving.grpc_status import answered_with_status
from common.serving.node_rpcs import NodeRpcs
from common.serving.rpc_convert import from_proto, to_proto
from prefill_node.node import PrefillNode
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc


class PrefillNodeService(NodeRpcs, duet_pb2_grpc.PrefillNodeServicer):
    node: PrefillNode

    def RemoteSend(self, request: pb.RemoteSendRequest, context) -> pb.RemoteSendResponse:
        def failed(exc: RequestError) -> None:
            self.node.metrics.requests.labels("RemoteSend", exc.code.name).inc()
            self.node.tracer.event(request.request_id, "failed", code=exc.code.name, error=str(exc))

        with answered_with_status(context, failed):
            sent = self.node.remote_send(from_proto(request, SendRequest), context.time_remaining())
        self.node.metrics.requests.labels("RemoteSend", "OK").inc()
        return to_proto(sent, pb.RemoteSendResponse)

