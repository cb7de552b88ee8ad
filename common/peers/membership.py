"""A health-checked set of nodes of one kind, each with its last reported load.

A poller thread calls every member's `GetLoad` (which doubles as the health check: a node
that does not answer within the timeout is unhealthy). Members can be added and removed while
requests run; a removed member's channel closes once the poller notices.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)

StubT = TypeVar("StubT")


@dataclass
class Member(Generic[StubT]):
    address: str
    channel: grpc.Channel
    stub: StubT
    healthy: bool = False
    load: pb.NodeLoad = field(default_factory=pb.NodeLoad)
    in_flight: int = 0  # requests routed here that have not finished
    routed: int = 0  # requests routed here so far (common/peers/routing.py breaks ties with it)
    in_flight_at_poll: int = 0  # of `load`'s requests, how many were this process's own

    @property
    def active_requests(self) -> int:
        """Requests running or queued there now, best guess: the node's report less this process's
        requests it counted (some have ended since), plus this process's requests now."""
        reported = self.load.running_requests + self.load.queued_requests
        return max(0, reported - self.in_flight_at_poll) + self.in_flight


class Membership(Generic[StubT]):
    def __init__(self, stub_class: type[StubT], addresses: list[str] = (), poll_seconds: float = 1.0,
                 rpc_timeout_s: float = 2.0, tls: TlsFiles = TlsFiles()) -> None:
        self._stub_class = stub_class
        self._tls = tls
        self._members: dict[str, Member[StubT]] = {}
        self._lock = threading.Lock()
        self._health_changed = threading.Condition(self._lock)
        self._poll_seconds = poll_seconds
        self._rpc_timeout_s = rpc_timeout_s
        self._stopped = threading.Event()
        self.on_load: Callable[[Member[StubT]], None] = lambda member: None  # after each successful poll
        self.on_health: Callable[[], None] = lambda: None  # after a member turned healthy or unhealthy
        for address in addresses:
            self.add(address)
        self._thread = threading.Thread(target=self._poll_loop, name="membership", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._members)

    def add(self, address: str) -> None:
        with self._lock:
            if address in self._members:
                return
            channel = self._tls.channel(address)
            member = self._members[address] = Member(address, channel, self._stub_class(channel))
        self.refresh(member)

    def remove(self, address: str) -> None:
        with self._lock:
            member = self._members.pop(address, None)
        if member is not None:
            self._set_health(member, False)
            member.channel.close()

    def set(self, addresses: list[str]) -> None:
        """Make the membership exactly `addresses`."""
        for address in set(self._members) - set(addresses):
            self.remove(address)
        for address in addresses:
            self.add(address)

    def members(self) -> list[Member[StubT]]:
        with self._lock:
            return list(self._members.values())

    def healthy(self) -> list[Member[StubT]]:
        with self._lock:
            return [m for m in self._members.values() if m.healthy]

    def wait_healthy(self, timeout: float) -> list[Member[StubT]]:
        """The healthy members, waiting up to `timeout` seconds for one when there is none."""
        with self._health_changed:
            self._health_changed.wait_for(lambda: any(m.healthy for m in self._members.values()), timeout)
            return [m for m in self._members.values() if m.healthy]

    @property
    def poll_wait_s(self) -> float:
        """The longest a member that came up waits to be seen healthy: a poll period and its call."""
        return self._poll_seconds + self._rpc_timeout_s

    def refresh(self, member: Member[StubT]) -> None:
        try:
            before = member.in_flight
            member.load = member.stub.GetLoad(pb.GetLoadRequest(), timeout=self._rpc_timeout_s)
            member.in_flight_at_poll = min(before, member.in_flight)
            self.on_load(member)
            if not member.healthy:
                log.info("node healthy", extra={"fields": {"address": member.address}})
            self._set_health(member, True)
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel was closed by remove()
            if member.healthy:
                log.warning("node unhealthy", extra={"fields": {"address": member.address, "error": str(exc)}})
            self._set_health(member, False)

    def mark_failed(self, member: Member[StubT]) -> None:
        """A request just failed there: stop routing to it until the next successful poll."""
        self._set_health(member, False)

    def _set_health(self, member: Member[StubT], healthy: bool) -> None:
        with self._health_changed:
            if member.healthy == healthy:
                return
            member.healthy = healthy
            self._health_changed.notify_all()
        self.on_health()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        for address in list(self._members):
            self.remove(address)

    def _poll_loop(self) -> None:
        while not self._stopped.wait(self._poll_seconds):
            with self._lock:
                members = list(self._members.values())
            for member in members:
                self.refresh(member)
