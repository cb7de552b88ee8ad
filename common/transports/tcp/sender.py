"""The sending half of the TCP transport: one connection per transfer, each layer's frame sent
by a sender thread so compute and transfer overlap (wire.py has the format)."""
from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np

from common.errors import ErrorCode
from common.kv.pool import KVPool
from common.transports import TransferError
from common.transports.pieces import Piece
from common.transports.sender_thread import SenderThread
from common.transports.tcp import wire
from protos.duet.v1 import duet_pb2 as pb

REFUSAL_WAIT_S = 1.0  # after a failed send, how long a refusal already on its way is waited for


class TcpTransfer(SenderThread):
    """One transfer. `post_layer` may be called from the forward thread as each layer finishes;
    the sender thread ships the frames on one connection."""

    def __init__(self, address: str, pool: KVPool, request_id: str, nonce: int, timeout_s: float = 30.0,
                 on_layer_done: Callable[[int], None] = lambda layer: None) -> None:
        host, port = address.rsplit(":", 1)
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot reach the KV receiver at {address}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().__init__(pool, timeout_s, on_layer_done, name="tcp-kv-send")
        rid = request_id.encode()
        self._queue.put([memoryview(wire.BEGIN.pack(wire.MAGIC, len(rid), nonce) + rid)])

    def post_layer(self, layer: int, pieces: list[Piece]) -> None:
        """Queue the layer's frame: its header, then the K and V rows of the pieces."""
        if not pieces:
            return
        runs = np.array([(p.dst_slot, p.num_slots) for p in pieces], dtype=wire.RUNS)
        header = [memoryview(wire.OP.pack(wire.OP_LAYER) + wire.LAYER.pack(layer, len(pieces)) + runs.tobytes())]
        pool, sb = self._pool, self._pool.slot_bytes()
        if wire.through_host(pool):
            staged, wait_copied = wire.stage_on_host(pool, layer, pieces)
            self._queue.put(wait_copied)  # the sender thread waits here, not the forward
            self._queue.put(header + [wire.writable_bytes(staged)])
        elif sum(p.num_slots for p in pieces) * sb < wire.STAGE_BELOW * len(pieces):  # short runs: one buffer,
            self._queue.put(header + [wire.writable_bytes(wire.gather_rows(pool, layer, pieces))])  # gathered here
        else:
            src = [(p.src_slot, p.num_slots) for p in pieces]
            self._queue.put(header + [view for kv in (0, 1)
                                      for view in wire.slot_views(wire.writable_bytes(pool.layer_kv(layer)[kv]), sb, src)])
        self._queue.put(layer)  # the sender reports the layer sent when it gets here

    def finish(self) -> None:
        """Send END and wait for the receiver's verdict; raises TransferError."""
        self._queue.put([memoryview(wire.OP.pack(wire.OP_END))])
        self._stop()
        try:
            # After a failed send only a refusal already on its way is worth reading.
            self._sock.settimeout(REFUSAL_WAIT_S if self._error else self._remaining())
            status, length = wire.recv_struct(self._sock, wire.REPLY)
            message = bytearray(length)
            wire.recv_exact(self._sock, memoryview(message))
        except TimeoutError:
            raise TransferError(f"the KV transfer missed its deadline: {self._error or 'no confirmation'}",
                                ErrorCode.DEADLINE_EXCEEDED) from None
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"the KV receiver did not confirm the transfer: {self._error or exc}") from None
        finally:
            self._sock.close()
        if status != ErrorCode.OK.value:
            code = next((c for c in ErrorCode if c.value == status), ErrorCode.UNKNOWN)
            raise TransferError(f"the decode node refused the transfer: {message.decode()}", code)

    def cancel(self) -> bool:
        """Close the connection. True: the receiver, which does the writing, pins the pages
        until it has seen the connection end."""
        self._queue.put(None)
        self._sock.close()
        return True

    def _take(self, item: object) -> None:
        """A layer number (report it sent), a staged layer's wait, or a frame to send."""
        if isinstance(item, int):
            self._on_layer_done(item)
            return
        try:
            if callable(item):  # a staged layer: wait for its device-to-host copy
                item()
                return
            self._sock.settimeout(self._remaining())
            wire.send_all(self._sock, item)
        except Exception as exc:  # not only OSError: a sender thread must never die silently
            self._error = exc  # keep draining; finish() reports it (after reading any reply)


class TcpSender:
    transport = "tcp"
    one_sided = False

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self._receivers: dict[str, str] = {}  # peer gRPC address -> its KV receiver address

    def connect(self, peer: str, info: pb.TransportInfo) -> None:
        host, port = info.tcp_address.rsplit(":", 1)
        if host in ("0.0.0.0", "::", ""):  # a wildcard listener: reach it where we reached gRPC
            host = peer.rsplit(":", 1)[0]
        self._receivers[peer] = f"{host}:{port}"

    def disconnect(self, peer: str) -> None:
        self._receivers.pop(peer, None)

    def open(self, peer: str, request_id: str, nonce: int, timeout_s: float,
             on_layer_done: Callable[[int], None] = lambda layer: None) -> TcpTransfer:
        return TcpTransfer(self._receivers[peer], self._pool, request_id, nonce, timeout_s, on_layer_done)

    def close(self) -> None:
        self._receivers.clear()
