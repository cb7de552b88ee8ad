"""Every live request of the decode node, with its status; every change of status happens here.

    QUEUED     --admitted, Generate's local prefill-->  RUNNING
    QUEUED     --admitted, PrepareReceive------------>  RESERVED
    RESERVED   --BeginTransfer----------------------->  RECEIVING   (RECEIVING again: a retrying writer)
    RECEIVING  --CompleteTransfer{abandoned}, or a
                 DATA_LOSS (bad checksums)----------->  RESERVED    (another writer may begin)
    RECEIVING  --CompleteTransfer-------------------->  RECEIVED
    RESERVED   --nothing to send (all cached)-------->  RECEIVED
    RECEIVED   --StartGeneration--------------------->  RUNNING
    RUNNING    --the scheduler finished it----------->  FINISHED
    RUNNING    --Migrate (or a drain)---------------->  MIGRATING
    MIGRATING  --the target failed before confirming->  RUNNING     (it decodes on here)
    MIGRATING  --its relayed stream ended------------>  FINISHED
    the other ends: QUEUED -> ABORTED; RESERVED | RECEIVING | RECEIVED -> ABORTED | EXPIRED | FAILED;
                    RUNNING | MIGRATING -> ABORTED

    QUEUED: waiting for admission (--admission queue); the request holds no pages.
    RESERVED: PrepareReceive reserved pages; no writer has begun. RECEIVING: a writer began
    (BeginTransfer; a retry on another writer stays RECEIVING). RECEIVED: the KV is all here.
    RUNNING: the scheduler computes and decodes it. MIGRATING: it moves to another decode node
    (decode_node/migration.py), then generates there while this node relays its stream. The ends: FINISHED (the scheduler finished
    it), ABORTED (Abort, a cancelled call, a waiter that gave up), EXPIRED (its lease ran out
    before StartGeneration), FAILED (its hand-off failed: the KV did not arrive, and Generate
    falls back to local prefill under a new entry).

A request that reaches an end leaves the table, and a reservation that ends gives its pages
back here. Any other transition is a bug and raises `IllegalTransition`. The table is guarded by
the engine lock (common/engine/core.py `locked`), as the pages its entries hold are.
"""
from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass

from common.engine.core import Engine, Sequence, locked
from common.engine.generation import Group, RequestHandle
from common.engine.sampling import SamplingParams
from common.kv.segments import Placement
from common.serving.retry_hint import RetryHint


class Status(enum.Enum):
    QUEUED = "queued"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    RECEIVED = "received"
    RUNNING = "running"
    MIGRATING = "migrating"
    FINISHED = "finished"
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"


S = Status
HOLDING_RESERVATION = frozenset({S.RESERVED, S.RECEIVING, S.RECEIVED})
ENDS = frozenset({S.FINISHED, S.ABORTED, S.EXPIRED, S.FAILED})
_NEXT: dict[Status, frozenset[Status]] = {
    S.QUEUED: frozenset({S.RESERVED, S.RUNNING, S.ABORTED}),
    S.RESERVED: frozenset({S.RECEIVING, S.RECEIVED, S.ABORTED, S.EXPIRED, S.FAILED}),
    S.RECEIVING: frozenset({S.RECEIVING, S.RESERVED, S.RECEIVED, S.ABORTED, S.EXPIRED, S.FAILED}),
    S.RECEIVED: frozenset({S.RUNNING, S.ABORTED, S.EXPIRED, S.FAILED}),
    S.RUNNING: frozenset({S.FINISHED, S.ABORTED, S.MIGRATING}),
    S.MIGRATING: frozenset({S.RUNNING, S.FINISHED, S.ABORTED}),
}


class IllegalTransition(RuntimeError):
    """A status change the state diagram does not have: a bug in the caller."""


@dataclass
class Reservation:
    """Pages PrepareReceive reserved for a writer: positions [begin, end) arrive where `placement`
    says (the sliding layers' window into the sliding group's slots, where the pool has one)."""

    seq: Sequence  # the matched prefix plus the reserved pages
    prefix_matched: int
    end: int
    placement: Placement
    nonce: int
    deadline: float  # time.time() seconds
    transfer_started: float | None = None  # time.perf_counter() of the writer's first BeginTransfer
    from_disk: int = 0  # of prefix_matched, positions read back from the disk tier for it
    writer: str = "computed"  # where the window's KV comes from, as duet_prompt_tokens counts it

    @property
    def begin(self) -> int:
        return self.end - self.placement.full.num_slots


@dataclass(eq=False)
class LiveRequest:
    """One request on this node, from admission to its end: what admission, a reservation, the
    scheduler and a migration each need of it. Compared by identity: an id may be taken again
    once its request ended."""

    request_id: str
    status: Status = S.QUEUED
    reservation: Reservation | None = None
    params: SamplingParams | None = None  # set once it runs: a migration hands them on
    handle: RequestHandle | None = None  # set once it runs: its instance in the scheduler
    abort_requested: bool = False  # an Abort came while it waited for admission
    admitted_at: float = 0.0  # time.monotonic() when it left QUEUED

    def runs(self, group: Group) -> bool:
        """Whether the scheduler's instance `group` (a `RequestHandle.group`) is this request's."""
        return self.handle is not None and self.handle.group is group


class RequestTable:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = engine.lock
        self._by_id: dict[str, LiveRequest] = {}
        self.retry_hint = RetryHint()  # how long admitted requests stay: when a refused one may come back

    @locked
    def get(self, request_id: str) -> LiveRequest | None:
        return self._by_id.get(request_id)

    @locked
    def add(self, request_id: str) -> LiveRequest:
        """A new request, QUEUED; a live one under the same id is a bug (callers check first)."""
        if request_id in self._by_id:
            raise IllegalTransition(f"request {request_id!r} is already live")
        entry = self._by_id[request_id] = LiveRequest(request_id)
        return entry

    @locked
    def move(self, entry: LiveRequest, to: Status) -> None:
        """Change `entry`'s status; an end removes it and gives back a reservation's pages."""
        if self._by_id.get(entry.request_id) is not entry or to not in _NEXT.get(entry.status, ()):
            raise IllegalTransition(f"request {entry.request_id!r}: {entry.status.name} -> {to.name}")
        if to in ENDS:
            del self._by_id[entry.request_id]
            if entry.status in HOLDING_RESERVATION:
                self.engine.release(entry.reservation.seq, cache=False)
            if entry.status is not S.QUEUED:
                self.retry_hint.record(time.monotonic() - entry.admitted_at)
        elif entry.status is S.QUEUED:
            entry.admitted_at = time.monotonic()
        entry.status = to

    @locked
    def run(self, entry: LiveRequest, params: SamplingParams, handle: RequestHandle) -> RequestHandle:
        """`entry` generates (RUNNING): `handle` is its instance in the scheduler."""
        entry.params, entry.handle = params, handle
        if entry.status is not S.RUNNING:
            self.move(entry, S.RUNNING)
        return handle

    @locked
    def holding(self, group: Group) -> LiveRequest | None:
        """The live request whose instance in the scheduler `group` is; None once it ended."""
        entry = self._by_id.get(group.request_id)
        return entry if entry is not None and entry.runs(group) else None

    @locked
    def end(self, request_id: str, to: Status) -> LiveRequest | None:
        """Move the live request `request_id` to the end `to`; None if none is live."""
        entry = self._by_id.get(request_id)
        if entry is not None:
            self.move(entry, to)
        return entry

    def holds_reservation(self, entry: LiveRequest) -> bool:
        """Whether `entry` is live and still holds its reservation (read without the lock by
        the transports' writers: a status is one attribute, read atomically)."""
        return entry.status in HOLDING_RESERVATION and self._by_id.get(entry.request_id) is entry

    @locked
    def counts(self) -> Counter[Status]:
        return Counter(e.status for e in self._by_id.values())

    @locked
    def with_status(self, status: Status) -> list[LiveRequest]:
        return [e for e in self._by_id.values() if e.status is status]

    @locked
    def admitted(self) -> int:
        """Requests that hold pages or run: what --max-running-requests caps."""
        return sum(1 for e in self._by_id.values() if e.status is not S.QUEUED)

    @locked
    def reserved_pages(self) -> int:
        return sum(len(e.reservation.seq.held_pages) for e in self._reserving())

    @locked
    def reserved_tokens(self) -> int:
        """Prompt tokens of the requests holding reservations."""
        return sum(len(e.reservation.seq.token_ids) for e in self._reserving())

    def awaiting_transfer(self) -> bool:
        """Whether any reservation still waits for its KV. Read without the lock, as a polling
        hint: a concurrent change may make it wrong for one poll."""
        try:
            return any(e.status in (S.RESERVED, S.RECEIVING) for e in list(self._by_id.values()))
        except RuntimeError:  # the dict changed size while being copied
            return True

    @locked
    def expire_due(self, now: float) -> list[LiveRequest]:
        """End the reservations whose lease passed `now` (time.time()); they were in the
        status they show."""
        due = [e for e in self._reserving() if e.reservation.deadline <= now]
        expired = []
        for e in due:
            expired.append(LiveRequest(e.request_id, e.status, e.reservation))
            self.move(e, S.EXPIRED)
        return expired

    @locked
    def end_all(self) -> None:
        """Shutting down: every reservation's pages go back (the scheduler ends its own)."""
        for e in list(self._reserving()):
            self.move(e, S.ABORTED)

    def _reserving(self) -> list[LiveRequest]:
        return [e for e in self._by_id.values() if e.status in HOLDING_RESERVATION]
