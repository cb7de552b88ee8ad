"""Generate's hand-off: reserve locally, have a prefill node push the prompt's KV, then decode.

Prefill nodes are tried in order of fewest requests in flight from this node; one that fails
before the KV arrived is skipped (and the next tried). When none succeeds, or the uncached part
of the prompt is short, the caller prefills locally instead.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from common.daemon import MAX_MESSAGE_BYTES
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)


class PrefillPool:
    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self._stubs = {
            a: duet_pb2_grpc.PrefillNodeStub(grpc.insecure_channel(
                a, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]))
            for a in addresses
        }
        self._in_flight = dict.fromkeys(addresses, 0)
        self._lock = threading.Lock()
        self._timeout_s = timeout_s

    def __bool__(self) -> bool:
        return bool(self._stubs)

    def _by_load(self) -> list[str]:
        with self._lock:
            return sorted(self._in_flight, key=self._in_flight.__getitem__)

    def push(self, request: pb.RemoteSendRequest, still_wanted: Callable[[], bool]) -> str | None:
        """RemoteSend to the least-loaded prefill node, falling through to the next on failure.
        Returns the address that delivered the KV, or None if none did."""
        for address in self._by_load():
            if not still_wanted():
                return None
            with self._lock:
                self._in_flight[address] += 1
            try:
                self._stubs[address].RemoteSend(request, timeout=self._timeout_s)
                return address
            except grpc.RpcError as exc:
                log.warning("remote prefill failed", extra={"fields": {
                    "prefill": address, "request_id": request.request_id, "code": exc.code().name,
                    "details": exc.details()}})
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    return None  # another prefill node would fail the same way
            finally:
                with self._lock:
                    self._in_flight[address] -= 1
        return None
