"""The interface every transport implements: a receiver on the pool that owns the KV pages and a
sender on any node that pushes KV into a peer's pages.

The KV owner (a decode node) opens a `KvReceiver` on its pool. It publishes what writers need in
the handshake (`info`), admits one writer at a time to a `WriteWindow` (a reservation's slots
under its transfer nonce; the window's pages are fenced while that writer may still write, see
fences.py), and hears the writer's report that it is done (`complete`). Any node opens a
`KvSender` on its own pool, `connect`s it to a peer with the peer's handshake, and `open`s one
`Transfer` per request, into which it posts, layer by layer, the (layer, K|V) slices of given
positions as `Piece`s (pieces.py): source slots here, destination slots there.

The control plane (BeginTransfer, CompleteTransfer) is the caller's; a transport only moves
bytes and says what it can prove about a writer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.kv.pool import KVPool
from common.kv.segments import Placement, Segments
from common.transports.fences import WriteFences
from common.transports.pieces import Piece
from protos.duet.v1 import duet_pb2 as pb


@dataclass(frozen=True)
class WriteWindow:
    """What one writer is admitted to write: a reservation's destination slots, the pages
    behind them (fenced while the writer may write), whether the reservation still exists, and
    which run of which writer writes (its incarnation; 0 when unknown), so that the fence can
    come down once that run is proven over."""

    request_id: str
    nonce: int
    placement: Placement
    pages: tuple[int, ...]
    alive: Callable[[], bool]
    writer: int = 0
    windowed: tuple[int, ...] = ()  # of `pages`, those whose sliding partners are fenced too

    def granted(self, pool: KVPool, layer: int) -> Segments:
        """The slots of `layer` the writer may write: its group's."""
        sliding = self.placement.sliding
        return sliding if sliding is not None and pool.is_sliding(layer) else self.placement.full


class KvReceiver(Protocol):
    transport: str
    fences: WriteFences

    def info(self) -> pb.TransportInfo:
        """What a writer needs to reach this pool (the handshake's transport part)."""

    def admit(self, window: WriteWindow) -> None:
        """Let one writer write `window` from now on."""

    def complete(self, request_id: str, nonce: int) -> bool:
        """The writer of (request_id, nonce) says it writes nothing more (done, or gave up with
        no write in flight). False if no fence of its was up."""

    def close(self) -> None: ...


class Transfer(Protocol):
    """One request's KV on its way to a peer."""

    @property
    def failed(self) -> bool:
        """The transfer cannot succeed any more (whatever feeds it can stop early)."""

    def post_layer(self, layer: int, pieces: list[Piece]) -> None:
        """Send the K and V of `pieces` of one layer (they must be in the pool already)."""

    def finish(self) -> None:
        """Wait until every posted byte has landed; raises TransferError."""

    def cancel(self) -> bool:
        """Stop the transfer; True when none of its writes can still land."""


class KvSender(Protocol):
    transport: str
    # True when writes land without the receiver seeing them: it must fence their pages until
    # this sender reports back (CompleteTransfer) or a quarantine ends.
    one_sided: bool

    def connect(self, peer: str, info: pb.TransportInfo) -> None:
        """Learn how to reach `peer` (its gRPC address) from its handshake."""

    def disconnect(self, peer: str) -> None: ...

    def open(self, peer: str, request_id: str, nonce: int, timeout_s: float,
             on_layer_done: Callable[[int], None] = lambda layer: None) -> Transfer:
        """A transfer that must be done within `timeout_s` of now; `on_layer_done(layer)` runs
        as each posted layer's bytes leave this node (NIXL: the write completed; TCP: they were
        handed to the socket)."""

    def close(self) -> None: ...
