"""The router daemon's gRPC face: duet.v1.DecodeNode's Generate (the other RPCs belong to
decode nodes and answer UNIMPLEMENTED here)."""
from __future__ import annotations

from collections.abc import Iterator

import grpc

from common.openai_http.endpoint_metrics import EndpointCounter
from common.serving.grpc_status import answered_with_status, retry_hint, retry_metadata
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from router.router import Router


class RouterService(duet_pb2_grpc.DecodeNodeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.http_requests = EndpointCounter(router.registry)

    def Generate(self, request: pb.GenerateRequest, context) -> Iterator[pb.GenerationChunk]:
        self.http_requests.count(context.invocation_metadata())
        try:
            with answered_with_status(context):
                for chunk in self.router.generate(request, context.time_remaining()):
                    if not context.is_active():
                        return
                    yield chunk
        except grpc.RpcError as exc:  # a decode or prefill node's status and retry hint, passed through
            if (seconds := retry_hint(exc)) is not None:
                context.set_trailing_metadata(retry_metadata(seconds))
            context.abort(exc.code(), exc.details())
