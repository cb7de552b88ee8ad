"""The KV data plane: how one node's K/V bytes reach another node's reserved slots.

One package per transport (`tcp/`, `nixl/`), each with both halves behind the interface of
`connector.py`: a receiver the KV owner opens on its pool, and a sender any node opens on its own
pool. `fences.py` is the one fencing concept both receivers use, `pieces.py` turns slot runs
into the byte ranges a transport moves, `metrics.py` counts transfers. Nothing outside this
package imports a transport's own types: daemons open them with `open_receiver` and
`open_sender`. May import common.kv, common.errors, cuda/, gRPC and protobuf messages; never the
model or the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from common.errors import ErrorCode

if TYPE_CHECKING:
    from common.kv.pool import KVPool
    from common.transports.connector import KvReceiver, KvSender
    from common.transports.fences import WriteFences

TRANSPORTS = ("nixl", "tcp")


class TransferError(Exception):
    """The KV did not (provably) reach the target; ``code`` is the status to report.

    ``in_flight`` is True when part of the transfer may still land later (a timed-out write: NIXL
    cancels it, but bytes UCX already handed to the transport are not called back). The pages
    behind it must then not be reused until the writer is provably gone. It is False when the
    target refused the write or is dead.
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE,
                 in_flight: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.in_flight = in_flight


def _unknown(transport: str) -> ValueError:
    return ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def open_receiver(transport: str, pool: KVPool, fences: WriteFences, host: str, advertise_host: str, name: str,
                  transfers_pending: Callable[[], bool]) -> KvReceiver:
    """The receiving half on `pool`: TCP listens on `host` (published as `advertise_host`), NIXL
    registers the pool as agent `name` and polls for progress briskly while
    `transfers_pending()`."""
    if transport == "tcp":
        from common.transports.tcp.receiver import TcpReceiver

        return TcpReceiver(pool, fences, host, advertise_host)
    if transport == "nixl":
        from common.transports.nixl.receiver import NixlReceiver

        return NixlReceiver(pool, fences, name, transfers_pending)
    raise _unknown(transport)


def open_sender(transport: str, pool: KVPool, name: str) -> KvSender:
    """The sending half on `pool` (NIXL: agent `name`)."""
    if transport == "tcp":
        from common.transports.tcp.sender import TcpSender

        return TcpSender(pool)
    if transport == "nixl":
        from common.transports.nixl.sender import NixlSender

        return NixlSender(pool, name)
    raise _unknown(transport)
