"""Handing a reserved prompt window to a prefill node, with retries across the pool.

Prefill nodes are tried least loaded first (queued prefill tokens reported by the node, plus
requests this process has in flight there). One that fails before the KV arrived is marked
unhealthy and the next is tried; errors another node would repeat (bad request, reservation
gone) end the attempt at once, and so does a timeout: callers size it to the reservation's lease, so
no other node could still deliver, and a node that is merely slow stays in the pool (a hung one
fails its next health poll).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from common.peers.membership import Member, Membership
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)

_FINAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)


class PrefillPool(Membership[duet_pb2_grpc.PrefillNodeStub]):
    def __init__(self, addresses: list[str] = (), poll_seconds: float = 1.0, timeout_s: float = 30.0,
                 tls: TlsFiles = TlsFiles()) -> None:
        super().__init__(duet_pb2_grpc.PrefillNodeStub, addresses, poll_seconds, tls=tls)
        self._timeout_s = timeout_s

    def by_load(self) -> list[Member]:
        return sorted(self.healthy(), key=lambda m: (m.load.queued_prefill_tokens, m.in_flight))

    def push(self, request: pb.RemoteSendRequest, still_wanted: Callable[[], bool] = lambda: True,
             lease_deadline_unix: float | None = None) -> str | None:
        """RemoteSend to the least-loaded healthy prefill node, falling through to the next on
        failure, within the reservation's lease when its deadline is given (else the pool's
        timeout). Returns the address that delivered the KV, or None if none did."""
        for member in self.by_load():
            timeout = self._timeout_s if lease_deadline_unix is None else lease_deadline_unix - time.time()
            if timeout <= 0:
                return None
            if not still_wanted():
                return None
            member.in_flight += 1
            try:
                member.stub.RemoteSend(request, timeout=timeout)
                return member.address
            except grpc.RpcError as exc:
                log.warning("remote prefill failed", extra={"fields": {
                    "prefill": member.address, "request_id": request.request_id, "code": exc.code().name,
                    "details": exc.details()}})
                if exc.code() in _FINAL:
                    return None
                self.mark_failed(member)
            finally:
                member.in_flight -= 1
        return None
