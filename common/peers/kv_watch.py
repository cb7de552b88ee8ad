"""Keeps a KvIndex fed from the WatchKvEvents streams of every node of a Membership.

One thread per member follows its stream. A stream that ends (the node drains, restarts, the
network drops) is reopened after `retry_seconds`, resuming from the last sequence applied; the
node replays what was missed or, after a restart or a long absence, answers with a snapshot. An
event that does not follow (a gap) or a refused resume drops what the index knew of the node and
reopens the watch from a snapshot. Members added or removed while running are followed.
"""
from __future__ import annotations

import logging
import threading

import grpc

from common.peers.kv_index import KvIndex
from common.peers.membership import Member, Membership
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)


class KvWatch:
    def __init__(self, membership: Membership, index: KvIndex, retry_seconds: float = 1.0) -> None:
        self.index = index
        self._membership = membership
        self._retry_seconds = retry_seconds
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._watching: dict[str, tuple[Member, threading.Event]] = {}
        self._calls: dict[str, grpc.Future] = {}
        self._thread = threading.Thread(target=self._follow_membership, name="kv-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        for address in list(self._watching):
            self._unwatch(address)

    def _follow_membership(self) -> None:
        while True:
            members = {m.address: m for m in self._membership.members()}
            for address in set(self._watching) - set(members):
                self._unwatch(address)
            for address, member in members.items():
                if address not in self._watching:
                    stop = threading.Event()
                    self._watching[address] = (member, stop)
                    threading.Thread(target=self._watch, args=(member, stop), name=f"kv-watch {address}",
                                     daemon=True).start()
            if self._stopped.wait(self._retry_seconds):
                return

    def _unwatch(self, address: str) -> None:
        _, stop = self._watching.pop(address)
        stop.set()
        with self._lock:
            call = self._calls.pop(address, None)
        if call is not None:
            call.cancel()
        self.index.forget(address)

    def _watch(self, member: Member, stop: threading.Event) -> None:
        while not stop.is_set():
            resume = self.index.resume_point(member.address)
            request = pb.WatchKvEventsRequest() if resume is None else \
                pb.WatchKvEventsRequest(incarnation=resume[0], after_sequence=resume[1])
            try:
                call = member.stub.WatchKvEvents(request)
                with self._lock:
                    self._calls[member.address] = call
                if stop.is_set():
                    call.cancel()
                for event in call:
                    if not self.index.apply(member.address, event):
                        log.info("kv events out of order: resyncing", extra={"fields": {"node": member.address}})
                        self.index.forget(member.address)
                        call.cancel()
                        break
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT):
                    self.index.forget(member.address)  # the node refused the resume point: start over
                elif exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("node serves no KV events", extra={"fields": {"node": member.address}})
            except ValueError:  # the member's channel was closed by Membership.remove
                return
            finally:
                with self._lock:
                    self._calls.pop(member.address, None)
            stop.wait(self._retry_seconds)
