"""The hand-off's steps (common/peers/hand_off.py) over a decode node's gRPC stub: how the router
reaches the decode node it hands a request to, and how a decode node migrating a request reaches
its target (decode_node/migration.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from common.errors import RequestError
from common.node_messages import ReceiveWindow
from common.serving.rpc_convert import from_proto
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc


class RemoteDecodeSteps:
    """PrepareReceive, Abort and StartGeneration of one request id on one decode node.

    `prepare_timeout`: how long PrepareReceive may wait in the node's admission queue (None: the
    call's own deadline). A node without room answers RESOURCE_EXHAUSTED, and `prepare` None.
    `wanted`: whether the caller still wants the reservation filled. `abort`: how the Abort of a
    request id is sent (a migration's writer reaches a peer whose channel a failed transfer closed).
    `continuation`: StartGeneration continues a generation in progress (a migrated request)."""

    def __init__(self, stub: duet_pb2_grpc.DecodeNodeStub, address: str, request_id: str, tokens: list[int],
                 sampling: pb.SamplingParams, continuation: pb.Continuation | None = None,
                 prepare_timeout: float | None = None, wanted: Callable[[], bool] = lambda: True,
                 abort: Callable[[str], object] | None = None) -> None:
        self.decode_address = address
        self.request_id = request_id
        self._stub, self._tokens, self._sampling, self._continuation = stub, tokens, sampling, continuation
        self._prepare_timeout, self._wanted = prepare_timeout, wanted
        self._abort = abort or (lambda request_id: stub.Abort(pb.AbortRequest(request_id=request_id)))
        self.reserved = False  # PrepareReceive reserved, and nothing released it since

    def prepare(self) -> ReceiveWindow | None:
        try:
            answer = self._stub.PrepareReceive(
                pb.PrepareReceiveRequest(request_id=self.request_id, token_ids=self._tokens),
                timeout=self._prepare_timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # the decode node's Generate queues instead of refusing
            raise
        self.reserved = True
        return from_proto(answer, ReceiveWindow)

    def still_wanted(self) -> bool:
        return self._wanted()

    def release(self) -> None:
        """Abort the reservation, if PrepareReceive made one (the id may be another's otherwise)."""
        if not self.reserved:
            return
        self.reserved = False
        try:
            self._abort(self.request_id)
        except (grpc.RpcError, RequestError):
            pass  # gone, claimed or expired already

    def start(self, kv_window_begin: int) -> Iterator[pb.GenerationChunk]:
        """The node's stream of chunks (a gRPC call: `cancel()` ends the request there)."""
        return self._stub.StartGeneration(pb.StartGenerationRequest(
            request_id=self.request_id, kv_window_begin=kv_window_begin, sampling=self._sampling,
            continuation=self._continuation))
