"""The decode node's request logic, independent of gRPC: reservations for incoming KV,
claiming them into the continuous-batching scheduler, single-node generation, aborts."""
from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from common.daemon_limits import MAX_REQUEST_ID_LENGTH
from common.engine.engine import Sequence
from common.engine.sampling import SamplingParams
from common.engine.scheduler import RequestHandle, Scheduler
from common.errors import Aborted, AlreadyExists, Cancelled, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from common.kv.kv_metadata import decode_segments, encode_segments
from common.model.model import LlamaModel
from common.model.tokenizer import Tokenizer
from common.peers.prefill_pool import PrefillPool
from common.serving.fingerprint import fingerprint_of, mismatch
from common.tracing import Tracer
from common.transports.tcp_transport import WriteGrant
from decode_node.admission import Admission, ReleaseNotifyingEngine
from decode_node.config import DecodeNodeConfig
from decode_node.kv_endpoint import open_endpoint
from decode_node.metrics import DecodeMetrics
from decode_node.reservations import Reservation, ReservationTable
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class PreparedReceive:
    prompt_length: int
    prefix_matched_length: int
    kv_window_begin: int  # the first position the writer must send
    kv_window_end: int
    kv_append_metadata: list[int]
    lease_deadline_unix: float
    transfer_nonce: int


class DecodeNode:
    def __init__(self, config: DecodeNodeConfig, model: LlamaModel, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine = ReleaseNotifyingEngine(model, config.kv_pages, config.page_size)
        self.tracer = Tracer(f"decode {config.advertise_address}", config.trace_requests)
        self.scheduler = Scheduler(self.engine, tokenizer, config.max_batch_tokens, tracer=self.tracer,
                                   max_step_ms=config.max_step_ms or None,
                                   speculative=config.speculative_config)
        self.reservations = ReservationTable(
            self.engine, on_expire=self._lease_expired, quarantine_seconds=config.quarantine_seconds,
            on_quarantine_expiry=lambda n: self.metrics.quarantine_expiries.inc(n))
        self.metrics = DecodeMetrics(self.engine, self.reservations)
        self.scheduler.speculator.observers.append(self.metrics.observe_speculation)
        self.admission = Admission(
            config, self.engine, running=lambda: self.scheduler.num_active() + len(self.reservations),
            admitted_tokens=lambda: self.scheduler.total_tokens() + self.reservations.reserved_tokens(),
            metrics=self.metrics)
        self._handing_off: set[str] = set()  # Generate requests waiting for a prefill node
        self._aborted_hand_offs: set[str] = set()
        self.prefill_pool = PrefillPool(list(config.prefill), timeout_s=config.lease_seconds, tls=config.tls,
                                        policy=config.routing_policy)
        self.kv_endpoint = open_endpoint(config.transport, self.engine.pool, self.authorize_write, config.host,
                                         config.advertise_host,
                                         name=f"decode-{config.host}-{config.port}-{uuid.uuid4().hex[:8]}",
                                         transfers_pending=self.reservations.awaiting_transfer)
        self.scheduler.start()
        self.reservations.start()

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def _lease_expired(self, r: Reservation) -> None:
        self.metrics.lease_expiries.inc()
        if r.transfer_under_way:
            self.metrics.transfers.failed("lease_expired")
        self.tracer.event(r.request_id, "lease_expired")

    def shutdown(self) -> None:
        self.prefill_pool.close()
        self.kv_endpoint.close()
        self.reservations.stop()
        self.scheduler.stop()
        with self.engine.lock:
            self.reservations.release_all()

    # ---- validation ----

    def _check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")

    def _check_prompt(self, token_ids: Seq[int]) -> list[int]:
        if not token_ids:
            raise InvalidArgument("the prompt is empty: send at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.engine.model.config.max_position_embeddings
        if len(token_ids) >= limit:
            raise InvalidArgument(f"the prompt has {len(token_ids)} tokens; the model's context holds {limit} "
                                  "including at least one generated token")
        return list(token_ids)

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.reservations or self.scheduler.is_active(request_id) or \
                self.admission.is_waiting(request_id):
            raise AlreadyExists(f"request {request_id!r} is still live; use a new request_id or Abort it first")

    # ---- admission (decode_node/admission.py); a reservation counts as admitted from
    # PrepareReceive on, so StartGeneration never finds the node full after the KV was moved ----

    def _footprint(self, positions: int) -> int:
        """Pages a sequence of `positions` positions occupies at most (a sliding window caps it)."""
        pages = -(-positions // self.engine.page_size)
        window = self.engine.window
        return pages if window is None else min(pages, window.max_pages(self.engine.page_size))

    def _admitted_sequence(self, request_id: str, tokens: list[int], end: int,
                           receiving: bool, use_prefix_cache: bool = True) -> tuple[Sequence, int]:
        """If admission lets it start now: a sequence holding the cached prefix of `tokens` and
        pages for positions up to `end`, and the first position it needs computed elsewhere
        (`receiving`: by a writer) or here. Else NotAdmitted, with nothing held."""
        seq = self.engine.new_sequence(request_id, tokens, use_prefix_cache)
        try:
            begin = self.engine.receive_begin(seq, end) if receiving else seq.num_computed
            self.admission.require_fit(self.engine.pages_needed(seq, end), len(tokens))
            self.engine.reserve(seq, end)
        except BaseException:
            self.engine.release(seq, cache=False)
            raise
        return seq, begin

    # ---- the three-call flow ----

    def prepare_receive(self, request_id: str, token_ids: Seq[int], kv_window_end: int | None,
                        cancelled: Callable[[], bool] = lambda: False,
                        deadline: float | None = None) -> PreparedReceive:
        """Reserve slots for positions [kv_window_begin, end) of the prompt: from the end of the
        cached prefix, or with a sliding window from the first position still attended. With
        --admission queue it waits for room until `cancelled()` or the `deadline` (monotonic)."""
        self._check_request_id(request_id)
        tokens = self._check_prompt(token_ids)
        n = len(tokens)
        end = -1 if kv_window_end is None else kv_window_end
        resolved = end + n if end < 0 else end
        if not 0 <= resolved < n:
            raise InvalidArgument(f"kv_window_end {end} resolves to {resolved}, outside [0, {n}) for a "
                                  f"{n}-token prompt (the decode node computes at least the last token)")
        with self.engine.lock:
            self._check_unused(request_id)
            seq, begin = self.admission.admit(
                request_id, self._footprint(resolved), n,
                lambda: self._admitted_sequence(request_id, tokens, resolved, receiving=True),
                cancelled, deadline)
            matched = seq.num_computed
            slots = self.engine.pool.slots_for(seq.pages, begin, resolved) if resolved > begin else []
            metadata = encode_segments(slots)
            lease_deadline = time.time() + self.config.lease_seconds
            reservation = Reservation(request_id, seq, matched, resolved, decode_segments(metadata),
                                      secrets.randbits(63), lease_deadline, complete=matched >= resolved)
            self.reservations.add(reservation)
        self.tracer.event(request_id, "prefix_matched", matched_tokens=matched, prompt_tokens=n)
        self.tracer.event(request_id, "pages_reserved", pages=len(seq.held_pages), slots=len(slots))
        self.metrics.prefix_hit_tokens.inc(matched)
        return PreparedReceive(n, matched, begin, resolved, metadata, lease_deadline, reservation.nonce)

    def _reservation_for_writer(self, request_id: str, nonce: int) -> Reservation:
        """Called with the lock held."""
        r = self.reservations.get(request_id)
        if r is None:
            raise NotFound(f"no reservation {request_id!r}: it was never made, expired or was aborted")
        if nonce != r.nonce:
            raise PermissionDenied(f"transfer_nonce does not match the one issued for {request_id!r}")
        return r

    def begin_transfer(self, request_id: str, nonce: int, metadata: list[int]) -> None:
        with self.engine.lock:
            r = self._reservation_for_writer(request_id, nonce)
            if r.complete:
                raise FailedPrecondition(f"the transfer for {request_id!r} already completed")
            n = len(r.segments)
            if len(metadata) != 2 * n + 1 or metadata[0] != n or decode_segments(metadata) != r.segments:
                raise InvalidArgument(f"kv_append_metadata does not match the slots reserved for {request_id!r}")
            if self.kv_endpoint.one_sided:  # nothing here can stop its writes: fence them
                self.reservations.fences.pin(request_id, nonce, r.seq.held_pages)
            r.transfer_started = time.perf_counter()
        self.tracer.event(request_id, "transfer_started")

    def complete_transfer(self, request_id: str, nonce: int, abandoned: bool = False) -> None:
        """The writer is done: its KV is all here, or (`abandoned`) it gave up and writes nothing
        more. Either way its fence comes down, even when its reservation is already gone."""
        with self.engine.lock:
            unfenced = self.reservations.fences.unpin(request_id, nonce)
            r = self.reservations.get(request_id)
            if abandoned and unfenced and (r is None or r.nonce != nonce):
                return
            r = self._reservation_for_writer(request_id, nonce)
            if abandoned:
                self.metrics.transfers.failed("abandoned")
            elif not r.complete:
                r.complete = True
                tokens = sum(n for _, n in r.segments)
                pool = self.engine.pool
                self.metrics.transfers.completed(tokens * 2 * pool.num_layers * pool.slot_bytes(),
                                                 time.perf_counter() - (r.transfer_started or time.perf_counter()),
                                                 len(r.segments))
        self.tracer.event(request_id, "transfer_abandoned" if abandoned else "transfer_complete")

    def authorize_write(self, request_id: str, nonce: int) -> WriteGrant:
        """Let a transport write a reservation's slots; its pages stay pinned until `unpin`, so
        an expiry or abort during the write cannot recycle them under the writer."""
        with self.engine.lock:
            r = self._reservation_for_writer(request_id, nonce)
            if r.complete:
                raise FailedPrecondition(f"the transfer for {request_id!r} already completed")
            pages = r.seq.held_pages
            self.engine.allocator.incref(pages)

        def unpin() -> None:
            with self.engine.lock:
                self.engine.allocator.decref(pages)

        return WriteGrant(r.segments, unpin, alive=lambda: self.reservations.get(request_id) is r)

    def transport_info(self, theirs: pb.CompatibilityFingerprint, transport: str) -> pb.TransportInfo:
        ours = fingerprint_of(self.engine.model, self.engine.pool)
        if (why := mismatch(ours, theirs, "decode node", "prefill node")) is not None:
            raise FailedPrecondition(f"{why}; run both nodes with the same model, dtype and --page-size")
        if transport != self.kv_endpoint.transport:
            raise FailedPrecondition(f"this decode node receives KV over {self.kv_endpoint.transport!r}, "
                                     f"not {transport!r}: start both nodes with the same --transport")
        info = self.kv_endpoint.info()
        info.fingerprint.CopyFrom(ours)
        info.num_slots = self.engine.pool.num_slots
        return info

    def start_generation(self, request_id: str, kv_window_begin: int, params: SamplingParams) -> RequestHandle:
        self._check_request_id(request_id)
        self._check_speculation(params)
        if params.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs needs the whole prompt computed on the decode node: send it "
                                  "with Generate (StartGeneration continues a prompt prefilled elsewhere)")
        with self.engine.lock:
            r = self.reservations.get(request_id)
            if r is None:
                raise NotFound(f"no reservation {request_id!r}: call PrepareReceive first (or it expired)")
            if kv_window_begin != r.end:
                raise InvalidArgument(f"kv_window_begin {kv_window_begin} must equal the reservation's "
                                      f"kv_window_end {r.end}")
            if not r.complete:
                raise FailedPrecondition(f"the KV transfer for {request_id!r} has not completed yet")
            self.reservations.claim(request_id)
            r.seq.num_computed = max(r.prefix_matched, r.end)
            return self.scheduler.submit(request_id, r.seq, params)

    def _check_speculation(self, params: SamplingParams) -> None:
        try:
            self.config.speculative_config.check(params)
        except ValueError as exc:
            raise InvalidArgument(f"sampling: {exc}") from None

    def generate(self, request_id: str, token_ids: Seq[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False, deadline: float | None = None) -> RequestHandle:
        """The one-call form: hand the prompt to a prefill node when that is worth it, else (or
        when no prefill node delivers) prefill locally, reusing the prefix cache either way.
        `cancelled` tells whether the caller gave up (then nothing more is started); with
        --admission queue it waits for room until then or the `deadline` (monotonic).
        A request for prompt logprobs is computed here from its first token (module docstring
        of common/engine/scheduler.py)."""
        self._check_request_id(request_id)
        self._check_speculation(params)
        tokens = self._check_prompt(token_ids)
        scoring = params.prompt_logprobs is not None
        with self.engine.lock:
            self.admission.check_room()
        if not scoring and self.prefill_pool.healthy() and self._worth_remote(tokens):
            self._handing_off.add(request_id)
            try:
                handle = self._generate_remote(request_id, tokens, params, cancelled, deadline)
            finally:
                self._handing_off.discard(request_id)
            if request_id in self._aborted_hand_offs:
                self._aborted_hand_offs.discard(request_id)
                raise Aborted(f"request {request_id!r} was aborted during its hand-off to a prefill node")
            if handle is not None:
                return handle
        if cancelled():
            raise Cancelled(f"request {request_id!r} was cancelled by the client")
        with self.engine.lock:
            self._check_unused(request_id)
            seq = self._local_sequence(request_id, tokens, cancelled, deadline, use_prefix_cache=not scoring)
            self.tracer.event(request_id, "prefix_matched", matched_tokens=seq.num_computed, prompt_tokens=len(tokens))
            self.metrics.prefix_hit_tokens.inc(seq.num_computed)
            return self.scheduler.submit(request_id, seq, params)

    def _local_sequence(self, request_id: str, tokens: list[int], cancelled: Callable[[], bool],
                        deadline: float | None, use_prefix_cache: bool) -> Sequence:
        """Rejecting, the scheduler queues what the pool cannot hold yet (preempting as needed).
        Queuing, the prompt's pages (a sliding window's worth at most) are admitted and reserved
        up front, so requests wait in the admission queue rather than crowd the scheduler."""
        if not self.admission.queueing:
            self.admission.check_room()
            return self.engine.new_sequence(request_id, tokens, use_prefix_cache)
        n = len(tokens)
        pages = self._footprint(n)
        end = min(n, pages * self.engine.page_size)
        seq, _ = self.admission.admit(request_id, pages, n,
                                      lambda: self._admitted_sequence(request_id, tokens, end, receiving=False,
                                                                      use_prefix_cache=use_prefix_cache),
                                      cancelled, deadline)
        return seq

    def _worth_remote(self, tokens: list[int]) -> bool:
        with self.engine.lock:
            matched = self.engine.prefix_cache.matched_length(tokens[:-1])
        return len(tokens) - 1 - matched >= self.config.min_remote_prefill_tokens

    def _generate_remote(self, request_id: str, tokens: list[int], params: SamplingParams,
                         cancelled: Callable[[], bool], deadline: float | None) -> RequestHandle | None:
        """PrepareReceive, RemoteSend, StartGeneration; None if the KV did not arrive."""
        end = min(int((1 - self.config.pd_balance) * len(tokens)), len(tokens) - 1)
        try:
            p = self.prepare_receive(request_id, tokens, end, cancelled, deadline)
        except ResourceExhausted:
            return None  # local prefill queues in the scheduler (or admission) instead of refusing
        if p.kv_window_end > p.kv_window_begin:
            request = pb.RemoteSendRequest(
                request_id=request_id, token_ids=tokens, kv_window_begin=p.kv_window_begin,
                kv_window_end=p.kv_window_end, kv_append_metadata=p.kv_append_metadata,
                decode_address=self.config.advertise_address, transfer_nonce=p.transfer_nonce)
            wanted = lambda: request_id in self.reservations and not cancelled()  # noqa: E731
            with self.tracer.span(request_id, "remote_prefill") as span:
                span["prefill"] = self.prefill_pool.push(request, still_wanted=wanted,
                                                         lease_deadline_unix=p.lease_deadline_unix)
            if span["prefill"] is None or cancelled():
                with self.engine.lock:
                    self.reservations.release(request_id)
                return None
        try:
            return self.start_generation(request_id, p.kv_window_end, params)
        except (NotFound, FailedPrecondition):  # expired or aborted meanwhile
            with self.engine.lock:
                self.reservations.release(request_id)
            return None

    def load(self) -> pb.NodeLoad:
        with self.engine.lock:
            return pb.NodeLoad(
                kv_pages_total=self.engine.allocator.num_pages, kv_pages_free=self.engine.allocator.num_free,
                kv_pages_reserved=self.reservations.reserved_pages(),
                kv_pages_quarantined=self.reservations.quarantined_pages(),
                kv_pages_cached=self.engine.prefix_cache.num_cached_pages,
                running_requests=self.scheduler.num_active(),
                queued_requests=self.admission.queue_depth,
                queued_prefill_tokens=self.scheduler.pending_prefill_tokens())

    def abort(self, request_id: str) -> None:
        with self.engine.lock:
            r = self.reservations.get(request_id)
            if self.reservations.release(request_id):
                if r.transfer_under_way:
                    self.metrics.transfers.failed("aborted")
                self.tracer.event(request_id, "aborted", held="reservation")
                if request_id in self._handing_off:  # Generate must not fall back to local prefill
                    self._aborted_hand_offs.add(request_id)
                return
            if self.scheduler.abort(request_id) or self.admission.abort(request_id):
                return
        raise NotFound(f"no live request {request_id!r}")
