"""The decode node's side of the KV data plane: what it publishes in the transport handshake
and what receives the bytes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.kv.kv_pool import KVPool
from common.transports import TRANSPORTS
from common.transports.tcp_transport import Authorizer, TcpKvReceiver
from protos.duet.v1 import duet_pb2 as pb


class KvEndpoint(Protocol):
    transport: str
    # True when peers write into the pool without this node seeing the bytes (NIXL), so the
    # pages they were cleared to write need a fence (decode_node/write_fences.py).
    one_sided: bool

    def info(self) -> pb.TransportInfo: ...

    def close(self) -> None: ...


class TcpEndpoint:
    transport = "tcp"
    one_sided = False  # the receiver copies every byte itself and pins the pages meanwhile

    def __init__(self, pool: KVPool, authorize: Authorizer, host: str, advertise_host: str) -> None:
        self._receiver = TcpKvReceiver(pool, authorize, host=host)
        self._advertise_host = advertise_host or host

    def info(self) -> pb.TransportInfo:
        port = self._receiver.address.rsplit(":", 1)[1]
        return pb.TransportInfo(transport=self.transport, tcp_address=f"{self._advertise_host}:{port}")

    def close(self) -> None:
        self._receiver.close()


def open_endpoint(transport: str, pool: KVPool, authorize: Authorizer, host: str, advertise_host: str, name: str,
                  transfers_pending: Callable[[], bool]) -> KvEndpoint:
    if transport == "tcp":
        return TcpEndpoint(pool, authorize, host, advertise_host)
    if transport == "nixl":
        from decode_node.nixl_endpoint import NixlEndpoint

        return NixlEndpoint(pool, name, transfers_pending)
    raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
