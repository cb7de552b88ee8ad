"""WatchKvEvents, as both daemons serve it: a node's KvEventLog as a stream of duet.v1.KvEvent.

The stream opens with a snapshot (the pool's, then the disk tier's where it holds blocks), or
with the missed changes when the request resumes the incarnation it watched and the log still
holds them, then relays every published change. A watcher that falls further behind than the
log's history gets a fresh snapshot in-band rather than a gap. The stream ends when the daemon starts draining (the watcher reconnects elsewhere or
to the restarted node), so watches never hold up a graceful shutdown.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from common.daemon_limits import MAX_REQUEST_ID_LENGTH
from common.kv.events import POOL, KvChange, KvEventLog
from protos.duet.v1 import duet_pb2 as pb

MAX_WATCHERS = 64  # concurrent streams per node; more are RESOURCE_EXHAUSTED
_POLL_SECONDS = 0.5  # how often an idle stream checks that its caller and the daemon are still there


class KvEventStreams:
    def __init__(self, log: KvEventLog, draining: threading.Event) -> None:
        self._log = log
        self._draining = draining
        self._lock = threading.Lock()
        self._watchers = 0

    def watch(self, request: pb.WatchKvEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.KvEvent]:
        cursor = self._resume_point(request, context)
        with self._lock:
            if self._watchers >= MAX_WATCHERS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this node already serves {MAX_WATCHERS} KV event watches")
            self._watchers += 1
        try:
            yield from self._follow(cursor, context.is_active)
        finally:
            with self._lock:
                self._watchers -= 1

    def _resume_point(self, request: pb.WatchKvEventsRequest, context: grpc.ServicerContext) -> int | None:
        """The sequence to replay from, or None for a snapshot; bad resume requests are refused."""
        if len(request.incarnation) > MAX_REQUEST_ID_LENGTH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"incarnation is longer than {MAX_REQUEST_ID_LENGTH} characters")
        if not request.HasField("after_sequence"):
            return None
        if not request.incarnation:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "after_sequence needs the incarnation it was seen in")
        if request.incarnation != self._log.incarnation:
            return None  # the node restarted since: start over
        latest = self._log.sequence
        if request.after_sequence > latest:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"after_sequence {request.after_sequence} is past this incarnation's latest, {latest}")
        return request.after_sequence

    def _follow(self, cursor: int | None, active: Callable[[], bool]) -> Iterator[pb.KvEvent]:
        log = self._log
        while active() and not self._draining.is_set():
            changes = None if cursor is None else log.changes_after(cursor)
            if changes is None:
                cursor, media = log.snapshot_blocks()
                for medium, blocks in media.items():
                    if medium == POOL or blocks:
                        yield pb.KvEvent(incarnation=log.incarnation, sequence=cursor, snapshot=True,
                                         stored_blocks=[b.block_hash for b in blocks], block_size=log.block_size,
                                         medium=_wire_medium(medium))
                continue
            for change in changes:
                yield self._event(change)
                cursor = change.sequence
            log.wait(cursor, _POLL_SECONDS)

    def _event(self, change: KvChange) -> pb.KvEvent:
        return pb.KvEvent(incarnation=self._log.incarnation, sequence=change.sequence, stored_blocks=change.stored,
                          removed_blocks=change.removed, block_size=self._log.block_size,
                          medium=_wire_medium(change.medium))


def _wire_medium(medium: str) -> str:
    """KvEvent.medium: empty for the pool (what watchers before the field read), else the tier's name."""
    return "" if medium == POOL else medium
