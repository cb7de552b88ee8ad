"""A decode node as another node's parts call it for KV work: one client over the gRPC stub,
speaking the common/node_messages.py dataclasses, every failed call a `RequestError` that names the
node and keeps its status and retry hint (common/serving/grpc_status.py `error_from_rpc`).

Live migration and drain (GetLoad), prefix fetch (SendPrefix) and the KV writer (the transport
handshake, BeginTransfer, CompleteTransfer, Abort) reach decode nodes through it. The hand-off's
three calls, whose stream a router relays as it arrives, go over the stub itself
(common/peers/remote_decode.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from common.node_messages import NodeLoad, SendRequest
from common.serving.grpc_status import error_from_rpc
from common.serving.rpc_convert import from_proto, to_proto
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc


class ChannelClosed(Exception):
    """The client's channel was closed (its peer was dropped after a failed transfer)."""


class DecodeClient:
    def __init__(self, address: str, channel: grpc.Channel) -> None:
        self.address = address
        self.channel = channel
        self.stub = duet_pb2_grpc.DecodeNodeStub(channel)

    @classmethod
    def dial(cls, address: str, tls: TlsFiles) -> DecodeClient:
        """A client over a channel of its own (`close` it)."""
        return cls(address, tls.channel(address))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_load(self, timeout: float) -> NodeLoad:
        return from_proto(self._call(self.stub.GetLoad, pb.GetLoadRequest(), timeout), NodeLoad)

    def transport_info(self, fingerprint: pb.CompatibilityFingerprint, transport: str,
                       writer: pb.WriterIdentity, timeout: float) -> pb.TransportInfo:
        """The handshake: the node's transport endpoint for a writer of this model and transport
        (FAILED_PRECONDITION: an incompatible writer)."""
        request = pb.GetTransportInfoRequest(fingerprint=fingerprint, transport=transport, writer=writer)
        return self._call(self.stub.GetTransportInfo, request, timeout)

    def begin_transfer(self, request_id: str, nonce: int, metadata: list[int], writer_incarnation: int,
                       timeout: float) -> None:
        self._call(self.stub.BeginTransfer, pb.BeginTransferRequest(
            request_id=request_id, transfer_nonce=nonce, kv_append_metadata=metadata,
            writer_incarnation=writer_incarnation), timeout)

    def complete_transfer(self, request_id: str, nonce: int, timeout: float, checksums: Sequence[int] = (),
                          abandoned: bool = False) -> None:
        self._call(self.stub.CompleteTransfer, pb.CompleteTransferRequest(
            request_id=request_id, transfer_nonce=nonce, kv_checksums=checksums, abandoned=abandoned), timeout)

    def abort(self, request_id: str, timeout: float) -> None:
        self._call(self.stub.Abort, pb.AbortRequest(request_id=request_id), timeout)

    def send_prefix(self, request: SendRequest, timeout: float) -> None:
        """Have this node write a prefix it holds into `request.decode_address`'s reservation."""
        self._call(self.stub.SendPrefix, to_proto(request, pb.RemoteSendRequest), timeout)

    def _call(self, rpc, request, timeout: float):
        try:
            return rpc(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"decode node {self.address}") from None
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
            raise ChannelClosed(f"the channel to decode node {self.address} is closed") from None
