"""The prefill node's side of the KV data plane: connecting to a decode node's endpoint and
opening one transfer session per RemoteSend."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.kv.kv_pool import KVPool
from common.transports.tcp_transport import TcpKvSession
from prefill_node.prefill_scheduler import TransferSession
from protos.duet.v1 import duet_pb2 as pb


class KvPusher(Protocol):
    transport: str
    one_sided: bool  # writes land without the decode node seeing them: it fences their pages

    def connect(self, address: str, info: pb.TransportInfo) -> None: ...

    def disconnect(self, address: str) -> None: ...

    def open(self, address: str, request_id: str, nonce: int, timeout_s: float,
             on_layer_done: Callable[[int], None] = lambda layer: None) -> TransferSession:
        """A session whose transfer must be done within `timeout_s` of now; `on_layer_done(layer)`
        runs as each posted layer's bytes leave this node (NIXL: the write completed; TCP: they
        were handed to the socket)."""

    def close(self) -> None: ...


class TcpPusher:
    transport = "tcp"
    one_sided = False

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self._receivers: dict[str, str] = {}  # decode gRPC address -> its KV receiver address

    def connect(self, address: str, info: pb.TransportInfo) -> None:
        host, port = info.tcp_address.rsplit(":", 1)
        if host in ("0.0.0.0", "::", ""):  # a wildcard listener: reach it where we reached gRPC
            host = address.rsplit(":", 1)[0]
        self._receivers[address] = f"{host}:{port}"

    def disconnect(self, address: str) -> None:
        self._receivers.pop(address, None)

    def open(self, address: str, request_id: str, nonce: int, timeout_s: float,
             on_layer_done: Callable[[int], None] = lambda layer: None) -> TransferSession:
        return TcpKvSession(self._receivers[address], self._pool, request_id, nonce, timeout_s, on_layer_done)

    def close(self) -> None:
        self._receivers.clear()


def open_pusher(transport: str, pool: KVPool, name: str) -> KvPusher:
    if transport == "tcp":
        return TcpPusher(pool)
    if transport == "nixl":
        from prefill_node.nixl_push import NixlPusher

        return NixlPusher(pool, name)
    raise ValueError(f"unknown transport {transport!r}")
