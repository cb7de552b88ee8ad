"""KV data plane: how the prefill node's K/V bytes reach the decode node's reserved slots, and the
transfer metrics. May import common.kv, common.errors, cuda/ and gRPC; never the model or engine."""
from __future__ import annotations

import grpc

TRANSPORTS = ("nixl", "tcp")


class TransferError(Exception):
    """The KV did not (provably) reach the target; ``code`` is the gRPC status to report.

    ``in_flight`` is True when part of the transfer may still land later (a timed-out write: NIXL
    cancels it, but bytes UCX already handed to the transport are not called back). The pages
    behind it must then not be reused until the writer is provably gone. It is False when the
    target refused the write or is dead.
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 in_flight: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.in_flight = in_flight
