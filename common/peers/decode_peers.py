"""Decode nodes this node writes KV into: gRPC stub plus the transport handshake,
cached per address and dropped when the peer fails so a restarted peer is re-handshaken."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc

from common.errors import FailedPrecondition, InvalidArgument, RequestError, Unavailable
from common.serving.tls import TlsFiles
from common.transports import TransferError
from common.transports.connector import KvSender
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class DecodePeer:
    address: str
    channel: grpc.Channel
    stub: duet_pb2_grpc.DecodeNodeStub
    info: pb.TransportInfo


class DecodePeers:
    def __init__(self, fingerprint: pb.CompatibilityFingerprint, identity: pb.WriterIdentity, sender: KvSender,
                 tls: TlsFiles) -> None:
        self._fingerprint = fingerprint
        self._identity = identity
        self._tls = tls
        self._sender = sender
        self._peers: dict[str, DecodePeer] = {}
        self._lock = threading.Lock()
        self._handshake_locks: dict[str, threading.Lock] = {}  # one handshake per address at a time

    def get(self, address: str) -> DecodePeer:
        with self._lock:
            if address in self._peers:
                return self._peers[address]
            handshake_lock = self._handshake_locks.setdefault(address, threading.Lock())
        with handshake_lock:  # a hung peer stalls only the requests that go to it
            with self._lock:
                if address in self._peers:
                    return self._peers[address]
            peer = self._handshake(address)
            with self._lock:
                self._peers[address] = peer
            return peer

    def drop(self, address: str) -> None:
        with self._lock:
            peer = self._peers.pop(address, None)
            if peer is not None:
                log.info("dropping decode peer", extra={"fields": {"decode_address": address}})
                self._sender.disconnect(address)
                peer.channel.close()

    def close(self) -> None:
        for address in list(self._peers):
            self.drop(address)

    def _handshake(self, address: str) -> DecodePeer:
        if not address or ":" not in address:
            raise InvalidArgument(f"decode_address {address!r} must be host:port")
        channel = self._tls.channel(address)
        stub = duet_pb2_grpc.DecodeNodeStub(channel)
        request = pb.GetTransportInfoRequest(fingerprint=self._fingerprint, transport=self._sender.transport,
                                             writer=self._identity)
        try:
            info = stub.GetTransportInfo(request, timeout=HANDSHAKE_TIMEOUT_S)
            self._sender.connect(address, info)
        except grpc.RpcError as exc:
            channel.close()
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(f"decode node {address}: {exc.details()}") from None
            raise Unavailable(f"decode node {address} is unreachable: {exc.details()}") from None
        except TransferError as exc:
            channel.close()
            raise RequestError(f"decode node {address}: {exc}", exc.code) from None
        log.info("handshake done", extra={"fields": {"decode_address": address, "transport": info.transport}})
        return DecodePeer(address, channel, stub, info)
