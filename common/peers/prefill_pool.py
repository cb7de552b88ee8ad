"""Handing a reserved prompt window to a prefill node, with retries across the pool.

Prefill nodes are tried in the order common/peers/routing.py ranks them (the same function the
router ranks decode nodes with): with prefix routing, a node that holds the prompt's prefix in its
cache (known from its KV events, which the pool watches) prefills only the rest. One that fails before the KV arrived is marked
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

from common.node_messages import SendRequest
from common.peers.kv_index import KvIndex
from common.peers.kv_watch import KvWatch
from common.peers.membership import Membership
from common.peers.peer_status import REQUEST_FAULT
from common.peers.routing import NodeChooser, RoutingPolicy
from common.serving.rpc_convert import to_proto
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)

class PrefillPool(Membership[duet_pb2_grpc.PrefillNodeStub]):
    def __init__(self, addresses: list[str] = (), poll_seconds: float = 1.0, timeout_s: float = 30.0,
                 tls: TlsFiles = TlsFiles(), policy: RoutingPolicy = RoutingPolicy()) -> None:
        super().__init__(duet_pb2_grpc.PrefillNodeStub, addresses, poll_seconds, tls=tls)
        self._timeout_s = timeout_s
        index = KvIndex() if policy.mode == "prefix" else None
        self._watch = KvWatch(self, index) if index is not None else None
        self.chooser = NodeChooser(policy, index)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        super().close()

    def push(self, request: SendRequest, still_wanted: Callable[[], bool] = lambda: True,
             lease_deadline_unix: float | None = None, preferred: str | None = None) -> str | None:
        """RemoteSend to the best-ranked healthy prefill node (`preferred` first, when it is a
        healthy member: a gateway that named one), falling through to the next on failure, within
        the reservation's lease when its deadline is given (else the pool's timeout). Returns the
        address that delivered the KV, or None if none did."""
        prompt = request.token_ids[: request.kv_window_end]  # what a prefill node computes
        message = to_proto(request, pb.RemoteSendRequest)
        ranked = self.chooser.rank(self.healthy(), prompt)
        ranked.sort(key=lambda choice: choice.member.address != preferred)  # stable: the rest keep their order
        for choice in ranked:
            member = choice.member
            timeout = self._timeout_s if lease_deadline_unix is None else lease_deadline_unix - time.time()
            if timeout <= 0:
                return None
            if not still_wanted():
                return None
            member.in_flight += 1
            self.chooser.note_routed(member, prompt)
            try:
                member.stub.RemoteSend(message, timeout=timeout)
                return member.address
            except grpc.RpcError as exc:
                log.warning("remote prefill failed", extra={"fields": {
                    "prefill": member.address, "request_id": request.request_id, "code": exc.code().name,
                    "details": exc.details()}})
                if exc.code() in REQUEST_FAULT:
                    return None
                self.mark_failed(member)
            finally:
                member.in_flight -= 1
        return None
