"""Live migration: a running request moves to another decode node mid-stream, and its client's
stream does not break. The hand-off of the three calls, pointed decode to decode.

The source (this node) takes the request out of its scheduler at a step boundary, pages and all
(`Scheduler.detach`). It asks the target to PrepareReceive each sample's context: the prompt plus
the tokens generated so far but the last, whose KV the target lacks beyond its own prefix cache.
It writes that KV into the reserved slots with the `KvWriter` a prefill node uses, over the same
transport, layer by layer, then calls StartGeneration with the generation's `Continuation`
(sampling state, output so far, random streams). The target's first chunk confirms it: the source
gives its pages back (into its prefix cache) and relays the target's chunks on the stream its
client holds, under the same request id.

Failures: a target that fails before confirming leaves the request decoding here, from its own
pages, as if nothing happened; a target that dies later leaves it here too, from the tokens
relayed so far (its context recomputed, mostly from the prefix cache). A source that dies leaves
the target's reservations to their lease, fenced like a dead prefill node's. An Abort (or a
cancelled client) during a migration ends the request on both nodes.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.daemon_limits import check_request_id
from common.engine.core import Engine, Sequence
from common.engine.generation import Chunk, Continuation, FinishReason
from common.engine.scheduler import Detached, Scheduler
from common.errors import (ErrorCode, FailedPrecondition, InvalidArgument, NotFound, RequestError, ResourceExhausted,
                           Unavailable)
from common.kv.segments import slot_range
from common.node_messages import MigrateResult, NodeLoad, ReceiveWindow, SendRequest
from common.peers.decode_client import DecodeClient
from common.peers.decode_peers import DecodePeer
from common.peers.hand_off import fill
from common.peers.kv_writer import TELL_TIMEOUT_S, KvWriter
from common.peers.peer_status import STALLED, STREAM_BROKEN
from common.peers.remote_decode import RemoteDecodeSteps
from common.serving.grpc_status import error_from_rpc, from_grpc
from common.serving.incarnation import INCARNATION
from common.serving.rpc_convert import chunk_from_proto, continuation_to_proto, sampling_to_proto
from common.tracing import Tracer
from decode_node.config import DecodeNodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.request_table import LiveRequest, RequestTable, Status
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 5.0  # a target that cannot reserve by then is full: the request decodes on here


class Outcome(enum.StrEnum):
    """How a migration ended: `duet_migrations_total{outcome}`."""

    MIGRATED = "migrated"  # the target generates it, this node relays its stream
    FAILED = "failed"  # the target did not take it: it decoded on here (or ended with the target's verdict)
    RESUMED = "resumed"  # the target died after taking it: it continued here
    ABORTED = "aborted"  # aborted (Abort, a cancelled client) during the migration


def sample_request_id(request_id: str, index: int, position: int) -> str:
    """The id a migrating sample's KV is reserved under on the target: the request's own for the
    first sample moved, "<request_id>#<index>" for the others."""
    return request_id if position == 0 else f"{request_id}#{index}"


@dataclass(eq=False)
class _Migration:
    entry: LiveRequest
    target: str
    reason: str
    detached: Detached | None = None
    call: grpc.Future | None = None  # the target's StartGeneration stream
    targets: list[RemoteDecodeSteps] = field(default_factory=list)  # each sample's steps with the target
    aborted: bool = False


@dataclass(eq=False)
class Migrations:
    config: DecodeNodeConfig
    engine: Engine
    scheduler: Scheduler
    requests: RequestTable
    writer: KvWriter
    metrics: DecodeMetrics
    tracer: Tracer
    _live: dict[LiveRequest, _Migration] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.lock = self.engine.lock
        self._idle = threading.Condition(self.lock)  # notified when a migration ends

    def target_load(self, target: str) -> NodeLoad:
        """The target's load; INVALID_ARGUMENT for a malformed address or this node itself."""
        if not target or ":" not in target:
            raise InvalidArgument(f"target_address {target!r} must be host:port")
        try:
            with DecodeClient.dial(target, self.writer.tls) as client:
                load = client.get_load(timeout=5.0)
        except RequestError as exc:
            raise Unavailable(f"target {exc} (unreachable)") from None
        if load.incarnation == INCARNATION:
            raise InvalidArgument(f"target_address {target} is this decode node: name another one")
        return load

    def migrate(self, request_id: str, target: str, reason: str = "rpc") -> MigrateResult:
        """Move running request `request_id` to the decode node at `target`; returns once the
        target confirmed (its first chunk), and relays the rest in the background."""
        check_request_id(request_id)
        self.target_load(target)
        peer = self.writer.peers.get(target)  # the handshake: an incompatible target is FAILED_PRECONDITION
        with self.lock:
            entry = self.requests.get(request_id)
            if entry is None:
                raise NotFound(f"no live request {request_id!r} on this node")
            if entry.status is not Status.RUNNING or entry.params is None:
                raise FailedPrecondition(f"request {request_id!r} is {entry.status.value}: only a running request "
                                         "moves (one being handed off or prefilled moves once it decodes)")
            m = self._live[entry] = _Migration(entry, target, reason)
            self.requests.move(entry, Status.MIGRATING)
        self.tracer.event(request_id, "migration_started", target=target, reason=reason)
        try:
            m.detached = self.scheduler.detach(entry.handle)
        except RequestError:
            self._end(m, Outcome.FAILED, resume=False)
            raise
        started = time.perf_counter()
        try:
            response, first = self._hand_over(m, peer)
        except BaseException as exc:
            try:
                self._clean_target(m)
            finally:  # whatever the clean-up met, the request decodes on here (or ends, if aborted)
                self._end(m, Outcome.ABORTED if m.aborted else Outcome.FAILED, resume=not m.aborted)
            if m.aborted:
                raise RequestError(f"request {request_id!r} was aborted during its migration",
                                   ErrorCode.ABORTED) from None
            if isinstance(exc, grpc.RpcError):
                raise error_from_rpc(exc, f"target decode node {target}") from None
            raise
        response.pause_seconds = time.perf_counter() - (m.detached.group.last_sent or started)
        self.scheduler.release(m.detached)
        self.metrics.migration_pause.observe(response.pause_seconds)
        self.metrics.migration_tokens.inc(response.tokens_moved)
        self.tracer.event(request_id, "migrated", target=target, tokens_moved=response.tokens_moved,
                          prefix_matched=response.prefix_matched_length, pause_s=round(response.pause_seconds, 4))
        threading.Thread(target=self._relay, args=(m, first), name=f"relay-{request_id[:16]}", daemon=True).start()
        return response

    def abort(self, entry: LiveRequest) -> bool:
        """End a migrating request on both nodes; False if `entry` is not migrating."""
        with self.lock:
            m = self._live.get(entry)
            if m is None:
                return False
            m.aborted = True
            call = m.call
        if call is not None:
            call.cancel()  # the target's stream ends: it aborts the request there
        return True

    def in_flight(self) -> int:
        with self.lock:
            return len(self._live)

    def wait_idle(self) -> None:
        """Until no migration or relay is in progress."""
        with self._idle:
            while self._live:
                self._idle.wait()

    def _hand_over(self, m: _Migration, peer: DecodePeer) -> tuple[MigrateResult, pb.GenerationChunk]:
        """The hand-off's steps with the target (common/peers/hand_off.py): each sample's window
        reserved there and filled from this node's pages, then one StartGeneration that continues
        them all; the response and the target's first chunk."""
        request_id, d = m.entry.request_id, m.detached
        deadline = time.monotonic() + self.config.lease_seconds
        sampling = sampling_to_proto(m.entry.params)
        continuation = continuation_to_proto(Continuation(tuple(s.state() for s in d.samples), d.group.cached_tokens,
                                                          d.group.completion_tokens))
        response = MigrateResult()
        first: ReceiveWindow | None = None
        for position, sample in enumerate(d.samples):
            self._check_aborted(m)
            steps = RemoteDecodeSteps(
                peer.client.stub, peer.address, sample_request_id(request_id, sample.index, position), sample.seq.token_ids,
                sampling, continuation if position == 0 else None, wanted=lambda: not m.aborted,
                abort=lambda rid: self.writer.tell(peer, lambda client: client.abort(rid, TELL_TIMEOUT_S)),
                # Not waiting in a full target's admission queue: the stream is paused meanwhile.
                prepare_timeout=min(PREPARE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
            m.targets.append(steps)
            window = fill(steps.request_id, sample.seq.token_ids, steps, _OwnPages(self, peer, sample.seq, deadline))
            self._check_aborted(m)
            if window is None:
                raise ResourceExhausted(f"target decode node {peer.address} has no room for the request now")
            first = first or window
            response.tokens_moved += window.kv_window_end - window.kv_window_begin
        response.prefix_matched_length = first.prefix_matched_length
        call = m.targets[0].start(first.kv_window_end)
        with self.lock:
            m.call = call
        self._check_aborted(m)
        return response, next(call)

    def _check_aborted(self, m: _Migration) -> None:
        if m.aborted:
            raise RequestError(f"request {m.entry.request_id!r} was aborted during its migration",
                               ErrorCode.ABORTED)

    def _clean_target(self, m: _Migration) -> None:
        """Best effort: end whatever the failed migration left on the target (its lease would)."""
        if m.call is not None:
            m.call.cancel()
        for steps in m.targets:
            steps.release()

    def _relay(self, m: _Migration, first: pb.GenerationChunk) -> None:
        """Relay the target's chunks to the client's stream until the request ends there."""
        d = m.detached
        msg = first
        try:
            while True:
                chunk = chunk_from_proto(msg)
                self.scheduler.absorb(d, chunk)
                d.group.send(chunk)
                if chunk.final:
                    ended = Outcome.ABORTED if chunk.finish_reason is FinishReason.ABORT else Outcome.MIGRATED
                    self._end(m, ended, resume=False)
                    return
                msg = next(m.call)
        except (grpc.RpcError, StopIteration) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
            if m.aborted:
                self._end(m, Outcome.ABORTED, resume=False)
            elif code in STREAM_BROKEN | STALLED:  # no answer of the target's own: it (or the way to it) is gone
                log.warning("migration target failed mid-stream: resuming here", extra={"fields": {
                    "request_id": m.entry.request_id, "target": m.target, "code": code.name}})
                self._end(m, Outcome.RESUMED, resume=True)
            else:  # the target's own verdict on the request (RESOURCE_EXHAUSTED, ...): the client's too
                d.group.send(Chunk([], "", FinishReason.ERROR, error_code=from_grpc(code), error=exc.details()))
                self._end(m, Outcome.FAILED, resume=False, end=Status.ABORTED)

    def _end(self, m: _Migration, outcome: Outcome, resume: bool, end: Status | None = None) -> None:
        """The migration is over: the request decodes on here (`resume`), or was aborted (its
        samples end here too), or ended on the target (`end`, or by its final chunk)."""
        d, entry = m.detached, m.entry
        with self.lock:
            self._live.pop(entry, None)
            self._idle.notify_all()
            live = self.requests.get(entry.request_id) is entry
            if d is not None and outcome is Outcome.ABORTED:
                self.scheduler.end_detached(d, FinishReason.ABORT)  # the last sample's end ends the entry
                if self.requests.get(entry.request_id) is entry:
                    self.requests.move(entry, Status.ABORTED)
            elif resume and d is not None and live:
                self.requests.move(entry, Status.RUNNING)
                self.scheduler.resume(d)
            elif live and d is None:
                self.requests.move(entry, Status.RUNNING)  # detach refused: it decodes on
            elif live:
                self.requests.move(entry, end or Status.FINISHED)
        self.metrics.migrations.labels(m.reason, outcome).inc()
        if outcome is not Outcome.MIGRATED:
            self.tracer.event(entry.request_id, "migration_ended", outcome=outcome, target=m.target)


@dataclass
class _OwnPages:
    """This node, as the hand-off calls the node that writes a window's KV: from `seq`'s pages."""

    migrations: Migrations
    peer: DecodePeer
    seq: Sequence
    deadline: float

    def push(self, request: SendRequest, still_wanted: Callable[[], bool] = lambda: True,
             lease_deadline_unix: float | None = None, preferred: str | None = None) -> str:
        """Write positions [kv_window_begin, kv_window_end) of `seq`; a failure raises, so the
        Migrate call reports it."""
        begin, end = request.kv_window_begin, request.kv_window_end
        engine = self.migrations.engine
        self.migrations.writer.write(self.peer, request.request_id, request.transfer_nonce,
                                     list(request.kv_append_metadata),
                                     slot_range(self.seq.pages, engine.page_size, begin, end), self.deadline)
        return self.peer.address
