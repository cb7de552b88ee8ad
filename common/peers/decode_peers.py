"""Decode nodes this node writes KV into: a client (common/peers/decode_client.py) plus the
transport handshake, cached per address and dropped when the peer fails so a restarted peer is
re-handshaken."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from common.errors import ErrorCode, FailedPrecondition, InvalidArgument, RequestError, Unavailable
from common.peers.decode_client import DecodeClient
from common.serving.tls import TlsFiles
from common.transports import TransferError
from common.transports.connector import KvSender
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class DecodePeer:
    client: DecodeClient
    info: pb.TransportInfo

    @property
    def address(self) -> str:
        return self.client.address


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
                peer.client.close()

    def close(self) -> None:
        for address in list(self._peers):
            self.drop(address)

    def _handshake(self, address: str) -> DecodePeer:
        if not address or ":" not in address:
            raise InvalidArgument(f"decode_address {address!r} must be host:port")
        client = DecodeClient.dial(address, self._tls)
        try:
            info = client.transport_info(self._fingerprint, self._sender.transport, self._identity,
                                         HANDSHAKE_TIMEOUT_S)
            self._sender.connect(address, info)
        except RequestError as exc:
            client.close()
            if exc.code is ErrorCode.FAILED_PRECONDITION:
                raise FailedPrecondition(str(exc)) from None
            raise Unavailable(f"{exc} (unreachable: a handshake needs it to answer)") from None
        except TransferError as exc:
            client.close()
            raise RequestError(f"decode node {address}: {exc}", exc.code) from None
        log.info("handshake done", extra={"fields": {"decode_address": address, "transport": info.transport}})
        return DecodePeer(client, info)
